"""omni.platforms.rocm: the AMD ROCm platform plugin.

plugin.py holds the hook implementations; attention.py (aiter flash attention,
SDPA), gemm.py (FP8 through ``torch._scaled_mm``) and graphs.py (HIP graphs)
the kernels; capabilities.py what the device and this torch can do. ROCm
presents itself to torch as CUDA (device type ``"cuda"``, ``torch.cuda``,
``torch.version.hip`` set). Importing the package has no side effects.
"""
