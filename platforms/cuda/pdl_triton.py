"""The device side of programmatic dependent launch (``pdl``): the wait each of the platform's Triton kernels
starts with.

The rule every kernel keeps, or PDL would race: ``wait_for_predecessor`` comes before its first read of anything
an earlier kernel writes and before its first write (a buffer the previous kernel still reads may be handed to
this one by the allocator). ``griddepcontrol`` needs sm_90, so kernels take ``PDL`` as a constexpr and other GPUs
compile without it; a kernel launched without the PDL attribute passes the wait at once. ``HAS_GDC``: whether
this Triton has it (``TritonKernels`` launches nothing with PDL otherwise).

``launch`` is how the platform's kernels launch under a policy (``pdl.Pdl``): each PDL class is a binary of its
own, so the first launch of a kernel's signature also compiles the policy's other classes, and no later row
class compiles in a request.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import Pdl
from .triton_compile import compiling, run_or_compile

_SIGNATURES: set = set()  # (kernel, policy, constexprs and options, tensor dtypes) whose classes are compiled

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


def launch(kernel, grid, pdl: Pdl, rows: int, *args, siblings: bool = True, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` with ``pdl``'s launch keywords for ``rows`` (``Pdl.kw``).

    The first launch of each signature (keyword constexprs and options, the tensors' dtypes) first compiles the
    binaries of the policy's classes together, in parallel (``triton_compile.compiling``: Triton's ``warmup``,
    compiled and cached, not run). Without it the first call past a class edge compiled in its request: after a
    server's warm-up, the first answer whose prompt crossed one compiled 4 kernels (1.5 s), the first 8 answers
    decoded together 7 (2.1 s; BENCHMARKS.md, "Thirtieth session"). A signature the build and the warm-up never
    launched still compiles on first use. ``siblings=False``: the caller compiles its classes itself (the sort
    and the few-row GEMM, whose tiles change with the rows too: ``compile_routes``, ``compile_rows``).
    The check costs a tuple and a set lookup a launch on the host where the policy has PDL (captured steps do
    not pay it); without PDL there is one class and no check.
    Inside ``compiling()`` nothing runs: the call's binary (and, with ``siblings``, its classes') is compiled.
    """
    if siblings and pdl.max_rows and _first_launch(kernel, pdl, args, kwargs):  # no PDL: one class, no check
        with compiling():  # inside an outer scope (the build's, a compile pass), joined to it
            for kw in pdl.classes():
                kernel.warmup(*args, grid=grid, **kwargs, **kw)
    run_or_compile(kernel, grid, *args, **kwargs, **pdl.kw(rows))


def _first_launch(kernel, pdl: Pdl, args: tuple, kwargs: dict) -> bool:
    """Whether this is the first launch of the signature (recorded now)."""
    key = (kernel, pdl, tuple(kwargs.items()), tuple(a.dtype if isinstance(a, torch.Tensor) else None for a in args))
    if key in _SIGNATURES:
        return False
    _SIGNATURES.add(key)
    return True
