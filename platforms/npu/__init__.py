"""omni.platforms.npu: the npu platform plugin (see plugin.py)."""
