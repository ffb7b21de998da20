"""The CUDA platform (placeholder until the CUDA kernels land in this file's package)."""
from omni.platforms.declining import DecliningPlatform

plugin = DecliningPlatform(name="cuda", device_type="cuda", dist_backend="nccl", vendor_module="flash_attn_interface")
