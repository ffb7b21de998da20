"""The rocm platform. Kernels land with the vendor-platform issue; until then it declines every spec."""
from omni.platforms.declining import DecliningPlatform

plugin = DecliningPlatform(name="rocm", device_type="cuda", dist_backend="nccl", vendor_module="aiter")
