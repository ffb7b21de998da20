"""omni.platforms.npu: the Huawei Ascend NPU platform plugin (torch_npu).

plugin.py holds the hook implementations; attention.py (FIA in TND layout,
SDPA), gemm.py (W8A8 ``npu_quant_matmul``, ``npu_grouped_matmul``) and
graphs.py (NPUGraph) the kernels; capabilities.py what the device and the
installed torch_npu can do. Importing the package imports no vendor module:
installing torch_npu without the CANN toolkit breaks ``import torch``, so
torch_npu is loaded only by detection, and only when it is installed.
"""
