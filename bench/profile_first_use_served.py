"""Stage times and Triton compiles per request through ``omni-run bench``'s in-process target (its scheduler and
engine loop, its prompt corpus), from an empty Triton cache: the h200_fp8 recipe at 32 random full-size layers,
built as ``serve`` builds it (its warm-up included unless ``--no-server-warm-up``), the bench's warm-up request, then the corpus' first four prompts twice at concurrency 1 (``--steps`` denoising
steps each; the prefill does not depend on them). A profiler wraps every prefill and prints where a slow one
(over 0.12 s) spent its time. ``profile_first_use.py`` drives the engine directly; this one goes the bench's way.

    TRITON_CACHE_DIR=/tmp/empty python bench/profile_first_use_served.py --steps 4
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time
from pathlib import Path

CACHE = os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="omni-triton-"))  # before triton loads

from omni import step_engine  # noqa: E402
from omni.bench_client import PROMPTS, InProcessTarget, corpus  # noqa: E402


def cubins() -> int:
    """Kernel binaries in the Triton cache (one .cubin per compiled variant)."""
    return sum(1 for _ in Path(CACHE).rglob("*.cubin"))


ENGINE_PREFILL = step_engine.StepEngine.prefill


def profiled_prefill(self, states):
    """The engine's prefill, timed, with the binaries it compiled, under a profiler (printed when slow)."""
    profile, k0, t0 = cProfile.Profile(), cubins(), time.perf_counter()
    profile.enable()
    try:
        return ENGINE_PREFILL(self, states)
    finally:
        profile.disable()
        dt = time.perf_counter() - t0
        print(f"  [prefill] {dt:.3f} s, tokens/row {[r.seq.prefix_len for s in states for r in s.rows]}, "
              f"cubins +{cubins() - k0}", flush=True)
        if dt > 0.12:
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(28)
            print(out.getvalue()[:6000])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--no-server-warm-up", dest="server_warm_up", action="store_false",
                   help="build only, as the bench did before the thirty-seventh session (no server warm-up)")
    a = p.parse_args()
    step_engine.StepEngine.prefill = profiled_prefill
    args = argparse.Namespace(recipe="h200_fp8", platform="cuda", model=None, full_size_layers=32,
                              set=["device.memory_gib=139"], max_running=0, levels=[1], requests=4,
                              sizes="1024x1024", prompts=None, steps=a.steps, guidance=5.0, seed=0,
                              server_warm_up=a.server_warm_up)
    t0 = time.perf_counter()
    target = InProcessTarget(args)
    print(f"ready {time.perf_counter() - t0:.1f} s, cubins {cubins()}", flush=True)
    bodies = corpus(args)
    print("warm-up (bench's: corpus[0])")
    target.send(bodies[0])
    for rnd in range(2):
        for b in bodies:
            smp = target.send(b)
            stages = {k: round(v, 3) for k, v in smp.stages.items()}
            print(f"round {rnd} prompt {PROMPTS.index(b['prompt'])}: {smp.latency_s:.2f} s {stages} cubins {cubins()}",
                  flush=True)
    target.close()


if __name__ == "__main__":
    main()
