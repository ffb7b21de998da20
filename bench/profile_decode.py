"""Where a captured text decode step's time goes: its kernels, their count and time, against the step's wall time.

Builds a recipe's pipeline as ``omni-run bench --full-size-layers`` does
(random weights, released widths; ``--layers`` of the 32), runs c greedy
answers once (JIT compiles, the decode graphs' captures), then records
``--steps`` decode steps of c answers under the torch profiler (CUPTI sees
the kernels a graph replay launches). Reported per step: wall time, the sum
of kernel times (what the device was busy with), the kernel count, and the
kernels by total time (per layer where they run once a layer), so the gap
between the wall time and the kernels' time, and the kernels worth fusing,
are measured rather than guessed. The host side of a step is split the
same way: each phase of ``text_steps.decode_step`` (the embedding, the RoPE
tables, the forward's table copies and replay, the logits, the sampling and
its host read, the detokenizing) is recorded as a labelled range, and the
host operators are listed by their own CPU time.

    python bench/profile_decode.py --recipe h200_instruct_fp8 --layers 8 --concurrency 1,8 --json out.json
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402
from bench_decode import answers, decode  # noqa: E402

from omni import text_steps  # noqa: E402
from omni.deployment import prepare  # noqa: E402

PHASES = ("embed", "rope", "text_forward", "text_logits", "draw_step", "collect", "emit")


def labelled(fn, label: str):
    """``fn`` inside a profiler range named ``label`` (what the host spends in one phase of a step)."""
    from torch.profiler import record_function

    def wrapped(*args, **kw):
        with record_function(label):
            return fn(*args, **kw)
    return wrapped


def label_phases(engine) -> None:
    """Wrap the phases of a decode step (bound methods on this engine's objects, functions of text_steps)."""
    for obj, names in ((engine.model, ("embed", "rope", "text_logits")), (engine, ("text_forward",)),
                       (text_steps, ("draw_step", "collect", "emit"))):
        for name in names:
            setattr(obj, name, labelled(getattr(obj, name), f"phase:{name}"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="h200_instruct_fp8")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (released: 32)")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--steps", type=int, default=16, help="decode steps recorded")
    p.add_argument("--eager", action="store_true", help="profile the eager decode step instead")
    p.add_argument("--sync", action="store_true", help="read each step's tokens before launching the next "
                   "(engine.text_lookahead off)")
    p.add_argument("--top", type=int, default=25, help="kernels listed")
    p.add_argument("--json", type=Path)
    return p.parse_args()


@torch.inference_mode()
def profiled_steps(engine, c: int, steps: int) -> tuple[float, list, list]:
    """(wall seconds of ``steps`` decode steps of ``c`` answers, the profiler's device events, its host
    averages)."""
    from torch.profiler import ProfilerActivity, profile

    states = [engine.admit(r) for r in answers(c, 100, steps + 2)]
    try:
        engine.prefill(states)
        engine.denoise_step(states)  # the first decode step outside the recording (a capture if new)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.denoise_step(states)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    finally:
        for s in states:
            engine.release(s)
    kernels = [e for e in prof.events()  # the phases' labels also show up as device ranges: not kernels
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("phase:")]
    return wall, kernels, prof.key_averages()


def host_summary(averages, steps: int, top: int) -> dict:
    """Host milliseconds per step of each labelled phase, and the host operators by their own CPU time."""
    cpu = [e for e in averages if e.device_type == torch.autograd.DeviceType.CPU]
    phases = {e.key.split(":", 1)[1]: round(e.cpu_time_total / steps / 1e3, 3)
              for e in cpu if e.key.startswith("phase:")}
    ops = sorted((e for e in cpu if not e.key.startswith("phase:")), key=lambda e: -e.self_cpu_time_total)
    return {"host_ms_per_step": {p: phases.get(p, 0.0) for p in PHASES},
            "host_top": [{"op": e.key[:80], "calls_per_step": round(e.count / steps, 2),
                          "self_cpu_us_per_step": round(e.self_cpu_time_total / steps, 1)} for e in ops[:top]]}


def summary(wall: float, kernels: list, steps: int, layers: int, top: int) -> dict:
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        row = by_name[e.name]
        row[0] += 1
        row[1] += e.device_time_total  # a device event: its own elapsed time
    busy_us = sum(t for _, t in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"step_ms": round(1e3 * wall / steps, 3), "kernel_ms_per_step": round(busy_us / steps / 1e3, 3),
            "kernels_per_step": round(sum(n for n, _ in by_name.values()) / steps, 1),
            "kernels_per_layer": round(sum(n for n, _ in by_name.values()) / steps / layers, 1),
            "top": [{"kernel": name[:120], "per_step": round(n / steps, 2), "us_per_step": round(t / steps, 1)}
                    for name, (n, t) in ranked]}


def main() -> int:
    a = parse()
    commit = git_commit()
    deployment = prepare(a.recipe, overrides={"device.memory_gib": 139, "graph.mode": "capture"}, random_weights=True)
    engine = deployment.build_pipeline(random_layers=a.layers, progress=False)
    graphs = engine.text_graphs
    label_phases(engine)
    engine.text_lookahead = not a.sync
    rows = []
    for c in (int(x) for x in a.concurrency.split(",")):
        engine.text_graphs = None if a.eager else graphs
        decode(engine, answers(c, 100, a.steps + 2))  # compiles, captures
        wall, kernels, averages = profiled_steps(engine, c, a.steps)
        row = {"concurrency": c, "mode": ("eager" if a.eager else "capture") + ("_sync" if a.sync else ""),
               **summary(wall, kernels, a.steps, a.layers, a.top), **host_summary(averages, a.steps, a.top)}
        print({k: v for k, v in row.items() if k not in ("top", "host_top")}, flush=True)
        for k in row["top"][:12] + row["host_top"][:15]:
            print("   ", k, flush=True)
        rows.append(row)
    out = {"recipe": a.recipe, "layers": a.layers, "steps": a.steps, "commit": commit,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
