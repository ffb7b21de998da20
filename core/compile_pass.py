"""The warm-up's compile pass (``serving.compile_first``): its requests run once with the platform's kernels
compiled instead of run, so that the compiles of every kernel they meet run together.

Why: a kernel compiled just in time compiles when a step first launches it, one after another as the step
reaches them. On the H200 the first image request's prefill took 6.6 s while it compiled 10 Triton binaries that
way, and the Instruct server's warm-up 17.3 s while it compiled 65, only each PDL signature's three classes
together (BENCHMARKS.md, "Thirty-first session"); the build's own compiles ran 16 at a time. A pass of the same
requests inside the platform's compile scope (``omni_compile_scope``) meets every signature first and hands each
compile to the platform's pool; the real warm-up then finds them compiled. Measured on the H200 (h200_fp8, 32
layers, empty cache): warm-up 8.3 / 7.9 s with the pass against 12.2 / 14.3 s without (BENCHMARKS.md,
"Thirty-fourth session").

What the pass keeps: requests run as usual (pages allocated and freed, no captured graph: ``StepGraphs`` runs
eagerly while ``active()``, the decode stays on the engine thread), but their outputs are undefined, since the
kernels that did not run left their buffers as they were; the results are dropped. The platform keeps every
output that later ops index with defined (hookspec). A request of the pass that raises is logged and the real
warm-up runs anyway: the pass only moves compiles earlier.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from contextvars import ContextVar

log = logging.getLogger("omni.compile_pass")
_ACTIVE: ContextVar[bool] = ContextVar("omni_compile_pass", default=False)


def active() -> bool:
    """Whether this thread runs inside a compile pass (its outputs undefined; nothing to capture)."""
    return _ACTIVE.get()


@contextmanager
def compile_pass(platform_scope):
    """The pass: ``platform_scope`` (the platform's ``omni_compile_scope`` context) entered and ``active()``
    true for its duration."""
    token = _ACTIVE.set(True)
    try:
        with platform_scope:
            yield
    finally:
        _ACTIVE.reset(token)


def run(scope, requests, run_to_end) -> float | None:
    """``run_to_end(request)`` for each of ``requests`` inside ``scope`` (the pipeline's ``compile_pass()``),
    their results dropped; seconds, or None when ``scope`` is None (no pass). A failure is logged, not raised:
    the warm-up then compiles as it runs."""
    if scope is None:
        log.info("serving.compile_first: the platform compiles nothing at first launch; no compile pass")
        return None
    t0 = time.perf_counter()
    try:
        with scope:
            for request in requests:
                run_to_end(request)
    except Exception as e:  # undefined outputs may trip a check; the real warm-up runs either way
        log.warning("compile pass failed, the warm-up compiles as it runs: %s: %s", type(e).__name__, e)
    seconds = time.perf_counter() - t0
    log.info("compile pass: %.1f s", seconds)
    return seconds
