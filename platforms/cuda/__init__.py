"""omni.platforms.cuda: the NVIDIA CUDA platform plugin.

plugin.py names this package's parts for the shared hook implementations
(``omni.platforms.common.plugin``) and the graph class (``torch.cuda.CUDAGraph``);
attention.py, gemm.py and moe.py (Triton parts in moe_triton.py, the sort in route_triton.py) the kernels; capabilities.py what the device and this
torch can do. Importing the package has no side effects (vendor modules load
lazily at resolution).
"""
