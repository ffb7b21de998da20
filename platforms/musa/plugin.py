"""The musa platform. Kernels land with the vendor-platform issue; until then it declines every spec."""
from omni.platforms.declining import DecliningPlatform

plugin = DecliningPlatform(name="musa", device_type="musa", dist_backend="mccl", vendor_module="torch_musa")
