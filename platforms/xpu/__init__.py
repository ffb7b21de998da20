"""omni.platforms.xpu: the xpu platform plugin (see plugin.py)."""
