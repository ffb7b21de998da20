"""Programmatic dependent launch (PDL) of the platform's Triton kernels at a decode step's sizes.

Why: a captured decode step of one answer runs ~23 kernels a layer of a few
microseconds each, and the graph still leaves about a microsecond between
two of them (bench/profile_decode.py: 6.40 ms a step for 5.56 ms of kernels,
BENCHMARKS.md "Seventeenth session"). A kernel launched with PDL is set up
while the kernel before it runs and waits on the device (``gdc_wait``) until
that kernel has finished and its writes are visible, instead of the launch
waiting: 173.2 -> 181.6 tokens/s for one answer on the H200, the same run
without it (BENCHMARKS.md "Eighteenth session", call C).

Measured: letting the next kernel launch early (``gdc_launch_dependents`` at a kernel's start) pays from a
step of 8 answers (``TRIGGER_ROWS``) and cost one answer 175.2 against 180.3 tokens/s; prefetching a dense
GEMM's weight into L2 before the wait was slower (160.0 with the early launch, 167.0 without) and is left out.

This module is the policy (no Triton import: the CPU tests read it); ``pdl_triton`` holds the device side and
the rule each kernel keeps. Captured graphs keep the programmatic edges.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

PDL_SM = (9, 0)  # griddepcontrol: Hopper and later
# Calls of at least this many rows (routed rows from 8 answers on, tokens from 64) also let the next kernel launch at
# once (``gdc_launch_dependents`` before the wait): 8 / 32 / 64 answers 793.1 / 2475.4 / 4671.1 against 785.4 /
# 2465.3 / 4613.3 tokens/s without, one run each (BENCHMARKS.md "Eighteenth session", call F). Below it the early
# launch cost one answer 175.2 against 180.3 tokens/s (call B), so one answer's calls (8 routed rows) keep the wait.
TRIGGER_ROWS = 64
# A call's launch keywords, one of three (read-only, made once): no PDL (and no ``launch_pdl`` key: a Triton older
# than the option may refuse it), PDL with the wait alone, PDL that also lets the next kernel launch early.
NO_PDL = MappingProxyType({"PDL": False, "TRIGGER": False})
WAIT = MappingProxyType({"PDL": True, "launch_pdl": True, "TRIGGER": False})
WAIT_AND_TRIGGER = MappingProxyType({"PDL": True, "launch_pdl": True, "TRIGGER": True})


@dataclass(frozen=True)
class Pdl:
    """Which calls launch with PDL: those of at most ``max_rows`` rows (0: none)."""

    max_rows: int = 0

    @classmethod
    def on_device(cls, max_rows: int, sm: tuple[int, int]) -> Pdl:
        """``max_rows`` (``kernels.pdl_rows``) where the device has PDL, else none."""
        return cls(max_rows if sm >= PDL_SM else 0)

    def classes(self) -> tuple[MappingProxyType, ...]:
        """Every set of launch keywords ``kw`` gives under this policy (one to three): a kernel has one binary
        for each (``pdl_triton.launch`` compiles them together)."""
        found = (self.kw(rows) for rows in (1, TRIGGER_ROWS, self.max_rows + 1))
        return tuple({id(k): k for k in found}.values())

    def kw(self, rows: int) -> MappingProxyType:
        """A call's launch keywords: the kernel's ``PDL`` and ``TRIGGER`` constexprs and Triton's ``launch_pdl``
        (the row count is a shape: a captured call keeps its choice)."""
        if not 0 < rows <= self.max_rows:
            return NO_PDL
        return WAIT_AND_TRIGGER if rows >= TRIGGER_ROWS else WAIT


OFF = Pdl()
