"""omni.platforms.npu: the Huawei Ascend NPU platform plugin (torch_npu).

plugin.py names this package's parts for the shared hook implementations
(``omni.platforms.common.plugin``) and the graph class (``torch.npu.NPUGraph``);
attention.py (FIA in TND layout, SDPA) and gemm.py (W8A8 ``npu_quant_matmul``,
``npu_grouped_matmul``) the kernels; capabilities.py what the device and the
installed torch_npu can do. Importing the package imports no vendor module:
installing torch_npu without the CANN toolkit breaks ``import torch``, so
torch_npu is loaded only by detection, and only when it is installed.
"""
