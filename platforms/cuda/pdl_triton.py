"""The device side of programmatic dependent launch (``pdl``): the wait each of the platform's Triton kernels
starts with.

The rule every kernel keeps, or PDL would race: ``wait_for_predecessor`` comes before its first read of anything
an earlier kernel writes and before its first write (a buffer the previous kernel still reads may be handed to
this one by the allocator). ``griddepcontrol`` needs sm_90, so kernels take ``PDL`` as a constexpr and other GPUs
compile without it; a kernel launched without the PDL attribute passes the wait at once. ``HAS_GDC``: whether
this Triton has it (``TritonKernels`` launches nothing with PDL otherwise).
"""
from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # a Triton without grid dependency control (older releases): kernels launch without PDL
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr, TRIGGER: tl.constexpr = False):
    """Under PDL: with ``TRIGGER`` first lets the next kernel launch (it waits in turn, so this only moves its
    launch earlier), then waits until the kernel before has finished and its writes are visible (no-op otherwise)."""
    if PDL:
        if TRIGGER:
            gdc_launch_dependents()
        gdc_wait()
