"""omni.platforms.rocm: the rocm platform plugin (see plugin.py)."""
