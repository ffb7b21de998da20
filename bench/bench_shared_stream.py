"""The shared expert on a side stream (``kernels.shared_expert_stream``) against inline, in one process.

One fp8 engine of ``--layers`` full-size random layers (``fast_setup.Setup``, as bench_fast builds it:
1024x1024, CFG, the recipe h200_fp8's kernels); every variant sets each MoE
layer's ``side`` and captures its own step graph. Rounds alternate the
variants (the H200 runs these steps at its power cap, so the clock drifts);
each round times ``--steps`` back-to-back replays of the whole step. The
output of every variant must equal inline's bit for bit (the same kernels on
the same inputs; only the streams differ), else the script exits 1.

    python bench/bench_shared_stream.py --layers 8 --rounds 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fast  # noqa: E402
import fast_setup  # noqa: E402

from omni.platform_manager import select  # noqa: E402
from omni.step_graphs import StepGraphs  # noqa: E402
from omni.streams import INLINE, SideStream  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="back-to-back step replays timed per round and variant")
    p.add_argument("--priorities", default="0,-1", help="side-stream priorities to try (lower is more urgent)")
    p.add_argument("--platform", default="cuda", help="cpu with --config small: a dry run of the script")
    p.add_argument("--config", choices=["released", "small"], default="released")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def variants(platform, priorities: list[int]) -> dict:
    services = platform.device_services(0)
    out = {"inline": INLINE}
    if services.current_stream() is not None:
        out.update({f"side_p{p}": SideStream(services, services.stream(priority=p)) for p in priorities})
    return out


def use(s, side, graphs: StepGraphs | None) -> None:
    for layer in s.model.model.layers:
        layer.mlp.side = side
    s.graphs = graphs


def time_steps(s, n: int) -> float:
    """Seconds per step over ``n`` back-to-back graph replays (one pair of events around all of them); eager
    where the platform cannot capture (the CPU dry run)."""
    graph = s.graphs is not None
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(n):
            s.step(graph)
        return (time.perf_counter() - t0) / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        s.step(graph)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def main() -> int:
    a = parse()
    platform = select(a.platform)
    dev = platform.device_services(0).device
    fa = bench_fast.parse(["--layers", str(a.layers), "--fast-accum", "--config", a.config])
    s = fast_setup.Setup(fa, platform, "fp8_row", dev)
    s.prefill()
    graphs, ref, result = {}, None, {"layers": a.layers, "steps_per_round": a.steps,
                                     "device": platform.info.device_name, "torch": torch.__version__,
                                     "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    sides = variants(platform, [int(p) for p in a.priorities.split(",")])
    for name, side in sides.items():
        graphs[name] = StepGraphs(platform, platform.info.device_type) if platform.info.accelerator else None
        use(s, side, graphs[name])
        latents, _ = s.step(graphs[name] is not None)
        if ref is None:
            ref = latents.clone()
        equal = torch.equal(latents, ref)
        result.setdefault("equal_to_inline", {})[name] = equal
        print(f"[{name}] captured; output equal to inline: {equal}", flush=True)
    times = {name: [] for name in sides}
    for r in range(a.rounds):
        for name, side in sides.items():
            use(s, side, graphs[name])
            time_steps(s, 2)  # the graph's first replays after a switch
            times[name].append(time_steps(s, a.steps))
        print(f"round {r}: " + ", ".join(f"{n} {t[-1]*1e3:.2f} ms" for n, t in times.items()), flush=True)
    base = statistics.median(times["inline"])
    for name, ts in times.items():
        med = statistics.median(ts)
        result.setdefault("step_s", {})[name] = {"median": med, "rounds": ts, "ratio_to_inline": med / base}
        print(f"{name}: step {med*1e3:.2f} ms ({a.layers} layers), {med/base:.4f}x inline", flush=True)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0 if all(result["equal_to_inline"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
