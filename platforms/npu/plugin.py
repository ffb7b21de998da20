"""The npu platform. Kernels land with the vendor-platform issue; until then it declines every spec."""
from omni.platforms.declining import DecliningPlatform

plugin = DecliningPlatform(name="npu", device_type="npu", dist_backend="hccl", vendor_module="torch_npu")
