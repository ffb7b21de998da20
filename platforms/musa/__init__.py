"""omni.platforms.musa: the Moore Threads GPU (MUSA) platform plugin (torch_musa).

plugin.py names this package's parts for the shared hook implementations
(``omni.platforms.common.plugin``) and the graph class (``torch.musa.MUSAGraph``);
attention.py (the vendor's FlashAttention build, SDPA) the kernels; gemm.py
why GEMMs are declined for now; capabilities.py what the device and the
installed torch_musa can do. Importing the package imports no vendor module
(torch_musa, like torch_npu, hooks into torch's backend autoload and needs
the MUSA SDK to load).
"""
