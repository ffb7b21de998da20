"""What a fresh server pays the first time it meets a prompt length: JIT compiles in the prefill and the step.

A serving process starts with an empty Triton cache (a new container) or a
warm one (a restart on the same disk). Triton compiles a kernel variant per
new specialization of its arguments, so the first request of each new
prompt length may wait for compiles that later requests do not. This builds
a recipe's pipeline as ``omni-run bench --full-size-layers`` does (random
weights, released widths), points Triton at an empty cache directory, and
runs requests whose prompts differ in length one after another, reporting
per request: prompt tokens per row, prefill and first/second step seconds,
and how many kernel binaries Triton compiled meanwhile.

    python bench/profile_first_use.py --recipe h200_fp8 --layers 8 --json out.json
    python bench/profile_first_use.py --recipe h200_fp8 --layers 8 --warm-up --json out.json   # as a server starts
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

CACHE = tempfile.mkdtemp(prefix="omni-triton-")
os.environ["TRITON_CACHE_DIR"] = CACHE  # before triton is imported: every compile of this run lands here

import torch  # noqa: E402

from omni.platform_manager import select  # noqa: E402
from omni.recipe import load_recipe  # noqa: E402
from omni.request import ImageRequest  # noqa: E402

WORDS = "a watercolour of a red fox in a snowy birch forest at dawn with soft light".split()


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="h200_fp8")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (released: 32)")
    p.add_argument("--words", default="3,7,8,12,16,23,31,40", help="prompt lengths in words, one request each")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--warm-up", action="store_true",
                   help="first the server's warm-up (serving.warmup_steps of a default request), as omni-run serve does")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def compiled() -> int:
    """Kernel binaries in the Triton cache (one .cubin per compiled variant)."""
    return sum(1 for _ in Path(CACHE).rglob("*.cubin"))


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def main() -> int:
    a = parse()
    recipe = load_recipe(a.recipe).replace_paths({"device.memory_gib": 139})
    from omni.models.hunyuan_image3.build import build_pipeline

    t0 = time.perf_counter()
    engine = build_pipeline(recipe, select(recipe.platform), random_layers=a.layers, progress=False)
    rows, before = [], compiled()
    print(f"built in {time.perf_counter() - t0:.1f} s; {before} Triton kernels compiled while building", flush=True)
    warm = None
    if a.warm_up:
        from omni.engine_handle import serving_scheduler

        t0 = time.perf_counter()
        serving_scheduler(engine, recipe, warm_up=True)
        torch.cuda.synchronize()
        warm = {"seconds": time.perf_counter() - t0, "steps": recipe.serving.warmup_steps, "compiled": compiled() - before}
        print(f"warm-up {warm['seconds']:.1f} s ({warm['steps']} steps), {warm['compiled']} kernels compiled", flush=True)
    for i, n in enumerate(int(w) for w in a.words.split(",")):
        prompt = " ".join((WORDS * (n // len(WORDS) + 1))[:n])
        req = ImageRequest(prompt=prompt, height=a.size, width=a.size, steps=3, guidance=recipe.defaults.guidance,
                           seed=i, template=recipe.defaults.template, system_prompt=recipe.defaults.system_prompt)
        s = engine.admit(req)
        k0 = compiled()
        prefill = timed(lambda: engine.prefill([s]))
        k1 = compiled()
        step1 = timed(lambda: engine.denoise_step([s]))
        step2 = timed(lambda: engine.denoise_step([s]))
        row = {"words": n, "prefix_tokens": s.rows[0].seq.prefix_len, "prefill_s": prefill, "step1_s": step1,
               "step2_s": step2, "compiled_in_prefill": k1 - k0, "compiled_in_steps": compiled() - k1}
        rows.append(row)
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        engine.release(s)
    out = {"recipe": a.recipe, "layers": a.layers, "size": a.size, "triton_cache": "empty at start",
           "compiled_while_building": before, "warm_up": warm, "requests": rows, "torch": torch.__version__,
           "device": torch.cuda.get_device_name()}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
