"""omni.platforms.musa: the Moore Threads GPU (MUSA) platform plugin (torch_musa).

plugin.py holds the hook implementations; attention.py (the vendor's
FlashAttention build, SDPA) and graphs.py (``torch.musa.MUSAGraph``) the
kernels; capabilities.py what the device and the installed torch_musa can do.
Importing the package imports no vendor module (torch_musa, like torch_npu,
hooks into torch's backend autoload and needs the MUSA SDK to load).
"""
