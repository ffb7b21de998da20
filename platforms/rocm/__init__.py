"""omni.platforms.rocm: the AMD ROCm platform plugin.

plugin.py names this package's parts for the shared hook implementations
(``omni.platforms.common.plugin``) and the graph class (HIP graphs behind
``torch.cuda.CUDAGraph``); attention.py (aiter flash attention, SDPA) and
gemm.py (FP8 through ``torch._scaled_mm``) the kernels; capabilities.py what
the device and this torch can do. ROCm presents itself to torch as CUDA
(device type ``"cuda"``, ``torch.cuda``, ``torch.version.hip`` set).
Importing the package has no side effects.
"""
