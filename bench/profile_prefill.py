"""Where a short prompt's prefill goes: device kernels against host time, per layer.

The headline's requests are short prompts (tens of tokens per CFG row), so the
prefill is one eager pass over ~100 tokens: every layer still reads all its
expert weights, and it launches every kernel of the layer once. This times the
prefill of bench_fast's model (``fast_setup.Setup``: released widths, random fp8 weights,
``--layers``; two rows of ``--prefix`` tokens) with CUDA events, sums its
kernels under torch.profiler, and lists the largest, so the gap between them
(host launch time the device waits for) is measured, not guessed.

    python bench/profile_prefill.py --layers 8 --prefix 48 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fast  # noqa: E402
import fast_setup  # noqa: E402
from bench_common import median_seconds  # noqa: E402

from omni.platform_manager import select  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prefix", type=int, default=48, help="prompt tokens per CFG row")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", type=Path)
    return p.parse_args()


def main() -> int:
    from torch.profiler import ProfilerActivity, profile

    a = parse()
    platform = select("cuda")
    dev = platform.device_services(0).device
    s = fast_setup.Setup(bench_fast.parse(["--layers", str(a.layers), "--prefix", str(a.prefix), "--fast-accum"]),
                         platform, "fp8_row", dev)
    for _ in range(3):
        s.prefill()
    torch.cuda.synchronize()
    wall = median_seconds(s.prefill, a.iters, warmup=1)
    t0 = time.perf_counter()
    s.prefill()
    host = time.perf_counter() - t0  # the host's time to enqueue one prefill (the device may still run)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        s.prefill()
        torch.cuda.synchronize()
    rows = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in p.key_averages()
                   if e.device_time_total > 0 and not e.key.startswith(("cudaLaunch", "cudaStream"))),
                  key=lambda r: -r[1])
    kernels = sum(r[1] for r in rows)
    L = a.layers
    out = {"layers": L, "prefix_per_row": a.prefix, "rows": 2, "device": platform.info.device_name,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "wall_ms": wall * 1e3, "host_enqueue_ms": host * 1e3, "kernel_sum_ms": kernels,
           "per_layer": {"wall_ms": wall * 1e3 / L, "host_ms": host * 1e3 / L, "kernels_ms": kernels / L},
           "top": [{"kernel": k[:110], "ms": t, "count": c} for k, t, c in rows[:15]]}
    print(f"prefill of 2 x {a.prefix} tokens, {L} layers: wall {wall*1e3:.2f} ms, host enqueue {host*1e3:.2f} ms, "
          f"kernels {kernels:.2f} ms; per layer {wall*1e3/L:.3f} / {host*1e3/L:.3f} / {kernels/L:.3f} ms", flush=True)
    for r in out["top"]:
        print(f"  {r['ms']:8.3f} ms x{r['count']:<4d} {r['kernel']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
