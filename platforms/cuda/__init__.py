"""omni.platforms.cuda: the NVIDIA CUDA platform plugin.

plugin.py holds the hook implementations; attention.py, gemm.py and graphs.py
the kernels; capabilities.py what the device and this torch can do. Importing
the package has no side effects (vendor modules load lazily at resolution).
"""
