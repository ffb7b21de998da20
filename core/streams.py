"""Work beside the current stream: fork it onto a side stream, join it where its result is read.

A MoE layer's shared expert does not depend on the routed path (router,
sort, gather, two grouped GEMMs), and the routed path's first kernels are
memory-bound; run side by side, the shared expert's GEMMs fill the SMs those
kernels leave idle (``kernels.shared_expert_stream``, BENCHMARKS.md).

``SideStream.run(fn, *args)`` enqueues ``fn(*args)`` on a side stream after
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

    enabled = False

    def run(self, fn: Callable, *args) -> Forked:
        return Forked(fn(*args))


INLINE = Inline()


class SideStream:
    """One side stream of a device (``omni.device.DeviceServices``), created on first use.

    ``priority`` is the stream priority torch takes (0 the default; lower is
    more urgent on CUDA-like devices).
    """

    enabled = True

    def __init__(self, services, priority: int = 0):
        self.services, self.priority, self._side = services, priority, None

    def run(self, fn: Callable, *args) -> Forked:
        side = self._stream()
        if side is None:  # a device type without streams
            return Forked(fn(*args))
        side.wait_stream(self.services.current_stream())
        with self.services.use_stream(side):
            result = fn(*args)
        return Forked(result, self.services, side)

    def _stream(self):
        if self._side is None:
            self._side = self.services.stream(priority=self.priority)
        return self._side
