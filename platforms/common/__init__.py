"""omni.platforms.common: device-generic pieces shared by platform plugins (no vendor imports).

plugin.py: ``DevicePlatform``, the hook implementations whose shape is the
same on every device, over a vendor's capabilities / attention / gemm modules.
graphs.py: one graph runner and pool helper for any ``torch.<device>`` graph
API. sdpa.py: packed-varlen SDPA attention, every device's fallback.
attention.py: run lengths, the default scale and the backend chain
(``first_fit``). Only ``torch`` and ``omni`` core are imported here; device
modules (``torch.npu``...) are looked up when a hook runs, never at import.
"""
