"""The xpu platform. Kernels land with the vendor-platform issue; until then it declines every spec."""
from omni.platforms.declining import DecliningPlatform

plugin = DecliningPlatform(name="xpu", device_type="xpu", dist_backend="xccl", vendor_module="intel_extension_for_pytorch")
