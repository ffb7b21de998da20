"""Small helpers every benchmark here shares: timing, host-to-device bandwidth, the commit, the JSON output."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch


def mean_seconds(dev, fn: Callable[[], object], repeat: int = 3) -> float:
    """Mean wall seconds of ``fn`` over ``repeat`` calls after one warm call, synchronized on ``dev`` (any device
    with ``synchronize()``: the offload and attention benches time host work too)."""
    fn()
    dev.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    dev.synchronize()
    return (time.perf_counter() - t0) / repeat


def median_seconds(fn: Callable[[], object], n: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``n`` runs, device events around each and no wait between runs (they queue
    back to back, as a step loop runs); the host clock on the CPU. ``cuda_event_median`` waits after each call."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) / 1e3


def h2d_bandwidth(dev, gib: int = 1) -> float:
    """Bytes per second of one pinned host -> device copy of ``gib`` GiB (what offload copies ride on)."""
    src = dev.pin(torch.empty(gib << 30, dtype=torch.uint8))
    dst = torch.empty_like(src, device=dev.device)
    return src.numel() / mean_seconds(dev, lambda: dst.copy_(src, non_blocking=True))


def git_commit() -> str:
    """The checkout's short commit, read when called (call it before a long run: HEAD may move); the environment's
    ``OMNI_BENCH_COMMIT`` instead where set: a copy of the tree on another machine may carry stale git metadata
    (a device copy reported 80fb79c for a 76ff06b tree)."""
    if os.environ.get("OMNI_BENCH_COMMIT"):
        return os.environ["OMNI_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def emit(out: dict, path: Path | None) -> int:
    """Print the result as JSON, and write it to ``path`` when given; the exit status of a bench's main."""
    text = json.dumps(out, indent=2)
    print(text)
    if path:
        path.write_text(text)
    return 0


def relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 distance of ``y`` from the reference ``ref`` (in fp64)."""
    return float((y.double() - ref).norm() / ref.norm())


def cuda_event_median(fn: Callable[[], object], iters: int = 30, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the current CUDA stream, timed with events (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def round_robin(fns: dict, rounds: int, burn: int = 200, iters: int = 10) -> dict:
    """Median seconds of each function over ``rounds`` rounds in which every one is timed in turn (CUDA events,
    ``iters`` calls each), after ``burn`` calls of the first: under a power cap the clock drifts as a run heats
    up, so no function may own the cool start or the hot end."""
    first = next(iter(fns.values()))
    for _ in range(burn):  # reach the power cap's steady clock before anything is timed
        first()
    per = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per[name].append(cuda_event_median(fn, iters=iters, warmup=1))
    return {name: statistics.median(ts) for name, ts in per.items()}


def captured(fn: Callable[[], object], chain: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` called ``chain`` times back to back, captured into one CUDA graph (after a warm call on a side
    stream, as the engine captures), so its kernels run without launch gaps, as in a captured step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(chain):
            fn()
    return graph


def chained_seconds(fns: dict, chain: int, rounds: int, burn: int, iters: int) -> dict:
    """Median seconds per call of each function: ``chain`` calls captured into one graph (``captured``), the
    graphs replayed in turn over ``rounds`` rounds (``round_robin``), so the kernels run back to back at the
    clocks of sustained running, as in a captured step."""
    graphs = {name: captured(fn, chain) for name, fn in fns.items()}
    t = round_robin({name: g.replay for name, g in graphs.items()}, rounds, burn=burn, iters=iters)
    return {name: s / chain for name, s in t.items()}


def round_robin_seconds(fns: dict, rounds: int, chain: int) -> dict:
    """Median seconds per call: eager calls round robin, or (``chain``) replays of ``chain`` captured calls."""
    if not chain:
        return round_robin(fns, rounds)
    return chained_seconds(fns, chain, rounds, burn=3 * len(fns), iters=3)
