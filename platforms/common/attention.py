"""Device-generic attention helpers: packed-run lengths, the default scale, and the backend chain.

May assume: ``torch`` only; no vendor module, no device. Every platform picks
its attention kernel the same way: under ``auto`` it walks its own ordered
chain of builders and takes the first that fits, keeping why the faster ones
were passed over; a named backend is the only one tried, and refusing it
refuses the spec (never a silent fallback). What the chain holds, its order
and every refusal reason stay in the vendor's ``attention.py``.

A builder is ``build(spec, caps, reject) -> impl | None``; it calls
``reject(reason)`` when the spec does not fit.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from omni.specs import AttentionSpec, Reject

Builder = Callable[[AttentionSpec, object, Reject], object]


def lengths(cu: tuple[int, ...]) -> list[int]:
    """Per-run lengths from host cumulative offsets with a leading 0 (``(0, 2, 5)`` -> ``[2, 3]``)."""
    return [b - a for a, b in zip(cu, cu[1:])]


def softmax_scale(spec: AttentionSpec) -> float:
    """``spec.scale``, or 1/sqrt(head_dim) when the spec leaves it to the kernel."""
    return spec.scale or 1.0 / math.sqrt(spec.head_dim)


def first_fit(platform: str, spec: AttentionSpec, caps, reject: Reject, builders: Mapping[str, Builder],
              auto: Sequence[str], lse: Sequence[str] = (), fp8: Sequence[str] = ()):
    """The first backend of ``auto`` (or the one ``spec.backend`` names) that fits ``spec``.

    ``lse`` names the backends that can also return the log-sum-exp (ring
    attention merges partial results with it); a spec asking for it is
    declined here, for every platform alike, by any other backend. ``fp8``
    names the backends with e4m3 attention products (``spec.fp8``): the same
    rule, so no backend computes an fp8 spec in bf16 unnoticed.

    The answer carries ``skipped``: why faster backends were passed over, for
    the trace. When none fits, every reason goes to ``reject`` prefixed with
    ``platform``, and the result is None.
    """
    if spec.return_lse and (spec.backend not in ("auto", *lse) or not lse):
        serving = f"only {', '.join(lse)} returns it here" if lse else "no backend here returns it yet"
        return reject(f"{platform}: attention with a log-sum-exp output: {serving}; the reference serves it")
    if spec.fp8 and (spec.backend not in ("auto", *fp8) or not fp8):
        serving = f"only {', '.join(fp8)} has fp8 kernels here" if fp8 else "no backend here has fp8 kernels"
        return reject(f"{platform}: attention.fp8: {serving}; the reference emulates it")
    if spec.backend == "auto":
        order = tuple(a for a in auto if not spec.fp8 or a in fp8)
    elif spec.backend in builders:
        order = (spec.backend,)
    else:
        return reject(f"{platform}: unknown attention backend {spec.backend!r} (choose auto, {', '.join(builders)})")
    skipped: list[str] = []
    for name in order:
        impl = builders[name](spec, caps, skipped.append)
        if impl is not None:
            impl.skipped = tuple(skipped)
            return impl
    for reason in skipped:
        reject(f"{platform}: {reason}")
    return None
