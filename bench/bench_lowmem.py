"""The FP8 model at full depth under a forced device-memory cap: routed experts streamed, some layers resident.

Recipe ``h200_lowmem`` on one card: the released shapes (all 32 decoder
layers, random weights, fp8_row), built one layer at a time so the bf16 model
never has to fit. One 1024x1024 CFG denoising step (2 rows, 8194 tokens,
``--batch`` requests packed) is timed twice in the same process:

  resident   every weight on the device, no cap: the baseline
  capped     the routed experts of layers >= ``--resident`` moved to pinned host
             memory and streamed through ``--window`` device slots; then the
             allocator is capped at ``--budget-gib`` (``DeviceServices.limit_memory``,
             what ``device.memory_limit_gib`` does), so any allocation past it fails

Reported: step times, their ratio, bytes streamed per step, the measured
host-to-device bandwidth, the transfer bound (streamed bytes / bandwidth), the
ideal step max(resident step, transfer bound), the overlap efficiency
(ideal / capped step: 1.0 = copies fully hidden), peak device memory under the
cap; then one whole request (``--steps`` steps + tiled VAE decode) under the cap.

    python bench/bench_lowmem.py --budget-gib 40 --resident 4 --batch 1 2 --json out.json
    python bench/bench_lowmem.py --platform cpu --config small --layers 2   # a dry run of the script
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import random_fullsize  # noqa: E402
from bench_common import emit, h2d_bandwidth  # noqa: E402
from random_model import build_random_pipeline  # noqa: E402

from omni.engine import Engine  # noqa: E402
from omni.offload import EXPERTS_ONLY, LayerOffloader  # noqa: E402
from omni.deployment import prepare  # noqa: E402
from omni.request import ImageRequest  # noqa: E402
from omni.vae_tiling import TileLanes  # noqa: E402

GiB = 2**30
# Moving the offloaded experts out leaves holes among resident tensors; expandable segments let
# empty_cache() return them, so the cap counts live memory, not fragmentation (set before CUDA starts).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--recipe", default="h200_lowmem")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--budget-gib", type=float, default=40.0, help="device memory cap for the capped run")
    p.add_argument("--resident", type=int, default=4, help="layers whose experts stay on the device")
    p.add_argument("--window", type=int, default=2, help="device slots the streamed experts rotate through")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="requests packed per step (each a CFG pair)")
    p.add_argument("--timed", type=int, default=3, help="timed steps per measurement")
    p.add_argument("--steps", type=int, default=4, help="steps of the whole request run under the cap (0 = skip)")
    p.add_argument("--config", choices=["released", "small"], default="released",
                   help="small: hidden 256, 8 experts (dry runs only)")
    p.add_argument("--size", default="1024x1024", help="WIDTHxHEIGHT of the requests")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def model_config(a):
    cfg = random_fullsize.released_layers(a.layers)
    if a.config == "small":
        cfg = dataclasses.replace(cfg, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  attention_head_dim=64, num_experts=8, moe_intermediate_size=(128,) * a.layers)
    return cfg


SIZE = (1024, 1024)


def request(steps: int, seed: int = 1) -> ImageRequest:
    return ImageRequest(prompt="a red cat on green grass", steps=steps, seed=seed, width=SIZE[0], height=SIZE[1])


def step_time(pipe, dev, batch: int, timed: int, off: LayerOffloader | None = None) -> tuple[float, float]:
    """Mean wall time of one packed denoising step of ``batch`` requests (after one warm step),
    and the bytes the offloader copied per timed step (0 without one)."""
    states = [pipe.admit(request(50, seed=i)) for i in range(batch)]
    try:
        pipe.prefill(states)
        pipe.denoise_step(states)
    except BaseException:
        for s in states:
            pipe.release(s)
        raise
    dev.synchronize()
    copied = off.stats.bytes_copied if off else 0
    try:
        t0 = time.perf_counter()
        for _ in range(timed):
            pipe.denoise_step(states)
        dev.synchronize()
        seconds = (time.perf_counter() - t0) / timed
    finally:  # an allocation past the cap must not leak the rows' KV pages
        for s in states:
            pipe.release(s)
    return seconds, ((off.stats.bytes_copied - copied) / timed if off else 0.0)


def log(msg: str, t0: float = 0.0) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}" if t0 else msg, file=sys.stderr, flush=True)


def whole_request(pipe, dev, steps: int) -> dict:
    """One request end to end (prefill, steps, tiled decode to uint8 on the host) under the cap."""
    dev.reset_peak_memory()
    t0 = time.perf_counter()
    out = Engine(pipe).run([request(steps)])[0]
    return {"steps": steps, "wall_s": time.perf_counter() - t0, "image_shape": list(out.image_HW3.shape),
            "denoise_s": out.times.denoise, "vae_s": out.times.vae,
            "peak_gib": dev.max_memory_allocated() / GiB}


def guarded(fn) -> dict:
    """Run ``fn``; an allocation past the cap is a result to report, not a crash."""
    try:
        return fn()
    except torch.OutOfMemoryError as err:
        return {"oom": str(err).splitlines()[0]}


def capped_run(pipe, dev, off, batch: int, timed: int, resident_s: float, bw: float) -> dict:
    def run():
        dev.reset_peak_memory()
        capped, streamed = step_time(pipe, dev, batch, timed, off)
        bound = streamed / bw
        ideal = max(resident_s, bound)
        return {"resident_step_s": resident_s, "capped_step_s": capped, "slowdown": capped / resident_s,
                "streamed_gib_per_step": streamed / GiB, "transfer_bound_s": bound, "ideal_step_s": ideal,
                "overlap_efficiency": ideal / capped, "peak_gib": dev.max_memory_allocated() / GiB}
    return {"batch": batch, **guarded(run)}


def build(a, platform, recipe):
    dev = platform.device_services(0)
    t0 = time.perf_counter()
    model = random_fullsize.build_random_model_layerwise(
        model_config(a), platform, dtype=torch.bfloat16, quant=recipe.quant.scheme,
        paged=recipe.kv_cache.mode == "paged", page_size=recipe.kv_cache.page_tokens, device=dev.device,
        progress=lambda i: log(f"  layer {i + 1}/{a.layers} built", t0))
    tiles = (recipe.vae.tile_latents, recipe.vae.overlap) if recipe.vae.tiling else None
    pipe = build_random_pipeline(recipe, platform, num_layers=a.layers, model=model, vae_tiles=tiles,
                                 vae_lanes=TileLanes(dev, recipe.vae.streams))
    return pipe, dev, time.perf_counter() - t0


def main() -> int:
    a = parse()
    global SIZE
    SIZE = tuple(int(v) for v in a.size.split("x"))
    deployment = prepare(a.recipe, platform=a.platform, random_weights=True)
    platform, recipe = deployment.platform(), deployment.recipe
    t_start = time.perf_counter()
    pipe, dev, build_s = build(a, platform, recipe)
    log("built", t_start)
    out = {"device": platform.info.device_name, "layers": a.layers, "quant": recipe.quant.scheme,
           "budget_gib": a.budget_gib, "resident_layers": a.resident, "window": a.window, "build_s": build_s,
           "resident_model_gib": dev.memory_stats().get("allocated_bytes", 0) / GiB}
    resident = {b: step_time(pipe, dev, b, a.timed)[0] for b in a.batch}
    log(f"resident steps {resident}", t_start)
    t0 = time.perf_counter()
    off = LayerOffloader(list(pipe.model.transformer.model.layers), dev, resident=a.resident, window=a.window,
                         keep=EXPERTS_ONLY)
    dev.empty_cache()
    out["offload_setup_s"] = time.perf_counter() - t0
    out["host_gib"] = off.host_bytes / GiB
    out["device_gib_after_offload"] = dev.memory_stats().get("allocated_bytes", 0) / GiB
    log(f"experts of {len(off.offloaded)} layers on the host", t_start)
    if dev.device.type != "cpu":
        out["cap_fraction"] = dev.limit_memory(int(a.budget_gib * GiB))
    bw = h2d_bandwidth(dev) if dev.device.type != "cpu" else float("nan")
    out["h2d_gib_s"] = bw / GiB
    out["runs"] = [capped_run(pipe, dev, off, b, a.timed, resident[b], bw) for b in a.batch]
    log(f"capped steps {out['runs']}", t_start)
    if a.steps:
        out["whole_request"] = guarded(lambda: whole_request(pipe, dev, a.steps))
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
