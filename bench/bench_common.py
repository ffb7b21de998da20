"""Small helpers every benchmark here shares: timing, host-to-device bandwidth, the commit, the JSON output."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch


def timed(dev, fn: Callable[[], object], repeat: int = 3) -> float:
    """Mean seconds of ``fn`` over ``repeat`` calls after one warm call, synchronized on ``dev``."""
    fn()
    dev.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    dev.synchronize()
    return (time.perf_counter() - t0) / repeat


def h2d_bandwidth(dev, gib: int = 1) -> float:
    """Bytes per second of one pinned host -> device copy of ``gib`` GiB (what offload copies ride on)."""
    src = dev.pin(torch.empty(gib << 30, dtype=torch.uint8))
    dst = torch.empty_like(src, device=dev.device)
    return src.numel() / timed(dev, lambda: dst.copy_(src, non_blocking=True))


def git_commit() -> str:
    """The checkout's short commit, read when called (call it before a long run: HEAD may move)."""
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


def cuda_event_median(fn: Callable[[], object], iters: int = 30, warmup: int = 3) -> float:
    """Median seconds of ``fn`` on the current CUDA stream, timed with events (after ``warmup`` calls)."""
    import statistics

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
