"""omni.platforms.xpu: the Intel GPU (XPU) platform plugin.

plugin.py names this package's parts for the shared hook implementations
(``omni.platforms.common.plugin``) and the graph class (``torch.xpu.XPUGraph``);
attention.py (IPEX varlen, SDPA) and gemm.py (FP8 through ``torch._scaled_mm``
where this torch has the XPU kernel) the kernels; capabilities.py what the
device and this torch can do. ``torch.xpu`` is core PyTorch; IPEX (archived
upstream, last release 2.8) is optional and imported lazily. Importing the
package has no side effects.
"""
