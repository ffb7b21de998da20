"""omni.platforms.cuda: the NVIDIA CUDA platform plugin (see plugin.py)."""
