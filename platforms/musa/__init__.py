"""omni.platforms.musa: the musa platform plugin (see plugin.py)."""
