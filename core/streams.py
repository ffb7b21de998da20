"""Work beside the current stream: fork it onto a side stream, join it where its result is read.

A MoE layer's shared expert does not depend on the routed path (router,
sort, gather, two grouped GEMMs), whose first kernels are memory-bound; run
side by side, the shared expert's GEMMs could fill the SMs those kernels leave
idle (``kernels.shared_expert_stream``). On one H200 it measured no gain
(0.9994-0.9998x the step, BENCHMARKS.md "Eleventh session"), so recipes leave
it off.

``SideStream.run(fn, *args)`` enqueues ``fn(*args)`` on its stream after
everything already enqueued on the current one and returns a ``Forked``;
``Forked.join()`` makes the current stream wait for it and returns the
result. ``INLINE`` runs ``fn`` at once (the CPU, or the option off), so the
model code is the same either way and the numbers are identical.

Memory: the caller keeps every input of ``fn`` referenced until it joins, so
the caching allocator cannot hand an input's block to the current stream
while the side stream still reads it; ``fn``'s own allocations belong to the
side stream and are reused there only after the next fork, which waits for
the current stream. Capture: a side stream that waits on a capturing stream
joins its capture (one graph, one memory pool) and must be joined before the
capture ends, which ``join`` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Forked:
    """``fn``'s result, valid on the side stream; ``join`` hands it to the current stream."""

    result: Any
    services: Any = None
    side: Any = None

    def join(self) -> Any:
        if self.side is not None:
            self.services.current_stream().wait_stream(self.side)
        return self.result


class Inline:
    """Runs ``fn`` at once on the current stream (no side stream: the CPU, or the option off)."""

    def run(self, fn: Callable, *args) -> Forked:
        return Forked(fn(*args))


INLINE = Inline()


class SideStream:
    """Work on ``side``, a stream of the device ``services`` (``omni.device.DeviceServices``) serves."""

    def __init__(self, services, side):
        self.services, self.side = services, side

    def run(self, fn: Callable, *args) -> Forked:
        self.side.wait_stream(self.services.current_stream())
        with self.services.use_stream(self.side):
            result = fn(*args)
        return Forked(result, self.services, self.side)
