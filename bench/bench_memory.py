"""Memory and step saving at full size: layer offload, VAE decode (tiled or not), step cache.

Released shapes with random weights (``--layers`` of 32 decoder layers).
  offload:    one 1024x1024 CFG step resident vs with the layers streamed
              from pinned host memory (``--window`` slots); the transfer bound
              is offloaded bytes / measured host-to-device bandwidth, and
              overlap efficiency = transfer bound / offloaded step time.
  vae:        released VAE decode at 1024 and 2048 px, untiled and tiled; tiled
              on one stream and on ``--lanes`` streams, eager and graph-replayed.
  step cache: steps computed vs skipped, the final-latent relative difference
              and the decoded image's PSNR/SSIM against no cache, per threshold.

    python bench/bench_memory.py --platform cuda --layers 4 --json out.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, h2d_bandwidth, mean_seconds  # noqa: E402
from random_model import build_random_pipeline  # noqa: E402

from omni.image_quality import psnr, ssim  # noqa: E402
from omni.offload import LayerOffloader  # noqa: E402
from omni.deployment import prepare  # noqa: E402
from omni.request import ImageRequest  # noqa: E402


def request(steps: int, cache: float = 0.0) -> ImageRequest:
    return ImageRequest(prompt="a red cat on green grass", steps=steps, seed=1, step_cache=cache)


def bench_offload(pipe, dev, window: int) -> dict:
    s = pipe.admit(request(50))
    pipe.prefill([s])
    step = lambda: pipe.denoise_step([s]) if s.step < 45 else None  # noqa: E731
    resident = mean_seconds(dev, step)
    dev.reset_peak_memory()
    off = LayerOffloader(list(pipe.model.transformer.model.layers), dev, window=window)
    dev.empty_cache()
    offloaded = mean_seconds(dev, step)
    bw = h2d_bandwidth(dev)
    bound = off.host_bytes / bw
    pipe.release(s)
    return {"resident_step_s": resident, "offloaded_step_s": offloaded, "window": window,
            "offloaded_gib": off.host_bytes / 2**30, "h2d_gib_s": bw / 2**30, "transfer_bound_s": bound,
            "overlap_efficiency": bound / offloaded, "slowdown": offloaded / resident,
            "peak_mem_gib_offloaded": dev.max_memory_allocated() / 2**30}


def bench_vae(pipe, dev, platform, lanes: int) -> dict:
    """Untiled vs tiled decode; tiled on one stream and on ``lanes`` streams, eager and graph-replayed."""
    from omni.step_graphs import StepGraphs
    from omni.vae_tiling import TileLanes, tiled_decode

    out, vae, dt = {}, pipe.model.vae, torch.bfloat16
    eager = lambda t: vae.decode_image(t, dtype=dt)  # noqa: E731
    for px in (1024, 2048):
        z = torch.randn(1, vae.cfg.latent_channels, px // 16, px // 16, device=dev.device)
        dev.reset_peak_memory()
        out[f"decode_{px}_s"] = mean_seconds(dev, lambda: eager(z), repeat=2)
        out[f"decode_{px}_peak_gib"] = dev.max_memory_allocated() / 2**30
        for n in sorted({1, lanes}):
            tl = TileLanes(dev, n)
            graphs = StepGraphs(platform, dev.device.type, name="vae_decode", max_graphs=2 * n, strict=False)
            replayed = lambda t: graphs.run(((tuple(t.shape), tl.current), ()), t, eager, lambda: ())  # noqa: E731
            for label, fn in (("eager", eager), ("graph", replayed)):
                dev.reset_peak_memory()
                tiles = lambda: tiled_decode(fn, z, tile=32, overlap=8, factor=16, lanes=tl)  # noqa: E731
                out[f"tiled_{px}_{label}_{n}stream_s"] = mean_seconds(dev, tiles, repeat=2)
                out[f"tiled_{px}_{label}_{n}stream_peak_gib"] = dev.max_memory_allocated() / 2**30
            graphs.clear()
            dev.empty_cache()
    return out


def bench_step_cache(pipe, dev, steps: int) -> list[dict]:
    def run(cache):
        s = pipe.admit(request(steps, cache))
        pipe.prefill([s])
        dev.synchronize()
        t0 = time.perf_counter()
        while not s.done:
            pipe.denoise_step([s])
        dev.synchronize()
        dt = time.perf_counter() - t0
        pipe.release(s)
        return s, dt

    base, t_base = run(0.0)
    base_img = pipe.decode(base)
    rows = []
    for thr in (0.05, 0.1, 0.2, 0.4):
        s, t = run(thr)
        rel = ((s.latents_1Chw - base.latents_1Chw).norm() / base.latents_1Chw.norm()).item()
        img = pipe.decode(s)
        rows.append({"threshold": thr, "skipped": s.cache.skipped, "steps": steps, "time_s": t,
                     "speedup": t_base / t, "final_latent_rel_diff": rel,
                     "psnr_db": psnr(img, base_img), "ssim": ssim(img, base_img)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--recipe", default="h200_fp8")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--cache-steps", type=int, default=20)
    p.add_argument("--lanes", type=int, default=2, help="streams the tiled VAE decode may use at once")
    p.add_argument("--parts", nargs="+", default=["step_cache", "vae", "offload"],
                   choices=["step_cache", "vae", "offload"])
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    deployment = prepare(a.recipe, platform=a.platform, overrides={"quant.scheme": "none", "graph.mode": "eager"},
                         random_weights=True)
    platform, recipe = deployment.platform(), deployment.recipe
    pipe = build_random_pipeline(recipe, platform, num_layers=a.layers)
    dev = platform.device_services(0)
    out = {"platform": platform.name, "device": platform.info.device_name, "layers": a.layers}
    parts = {"step_cache": lambda: bench_step_cache(pipe, dev, a.cache_steps),
             "vae": lambda: bench_vae(pipe, dev, platform, a.lanes),
             "offload": lambda: bench_offload(pipe, dev, a.window)}
    for name in a.parts:  # offload last: it moves the layers to the host for good
        out[name] = parts[name]()
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
