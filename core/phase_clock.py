"""Seconds per named phase of one long job (a pipeline's build), for the line that reports it done.

Why: a build's one figure (``omni_startup_seconds{part="build"}``) does not say where its seconds went. On a GPU
the first build of a machine took 20-22 s where a later one took 7-9 s with the same kernels compiled; the phases
put the difference in the modules phase, which led to the CUTLASS self-tests run one after another (BENCHMARKS.md,
"Fortieth session"). Device work runs behind the
host, so each phase ends by waiting for it (``sync``) where one is given: else a phase that only queued its work
would look free and the next phase that waits would be charged for it.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable


class PhaseClock:
    """``with clock.phase("weights"): ...`` adds that block's seconds to the phase; ``summary()`` reports them."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._t0 = time.perf_counter()
        self.sync = sync  # waits for the device's queued work; set once a device is bound (None: host only)
        self.seconds: dict[str, float] = {}  # phase -> seconds, in the order first entered

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        yield  # a block that raises is not timed: its error propagates unchanged
        if self.sync is not None:
            self.sync()
        self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def total(self) -> float:
        """Seconds since the clock was made (phases and whatever ran between them)."""
        return time.perf_counter() - self._t0

    def summary(self) -> str:
        """``"20.5 s (device 0.4, weights 17.0, other 0.1)"``: ``other`` is the time outside every phase."""
        total = self.total()
        parts = [f"{name} {s:.1f}" for name, s in self.seconds.items()]
        rest = total - sum(self.seconds.values())
        if rest >= 0.05:
            parts.append(f"other {rest:.1f}")
        return f"{total:.1f} s ({', '.join(parts)})" if parts else f"{total:.1f} s"
