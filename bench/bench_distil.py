"""Instruct-Distil end to end at the released shapes: 1024x1024 in 8 steps, one row per request.

The Distil pipeline (``HunyuanImage3InstructDistil``: ``<timestep> <guidance>
<timestep_r>`` + 4096 image tokens, one forward per step, no CFG row) over
all 32 released decoder layers with random weights in fp8_row (built one
layer at a time, ``random_fullsize.build_random_model_layerwise``), the
released VAE decoder, through the real scheduler (``omni.engine.Engine``:
admission, prefill, packed steps, decode, PNG-ready uint8): ``--requests``
requests per concurrency level, timed from submission to result.

All ``--requests`` are submitted at once and ``--concurrency`` run together,
so the p50 counts the queue wait (``p50_service_s`` leaves it out).
Reported per concurrency: p50 / p90 latency, images per hour, peak memory;
and the issue's goal (p50 <= 1.5 s, >= 3000 images/hour) as met or not.

    python bench/bench_distil.py --concurrency 1,4,8 --json bench/results/bench_distil_h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from importlib import resources
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402
from random_fullsize import build_random_model_layerwise, random_init_, released_layers  # noqa: E402

from omni.engine import Engine  # noqa: E402
from omni.kv_pool import KVPool  # noqa: E402
from omni.parallel.runtime import SingleDevice  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.request import ImageRequest  # noqa: E402
from omni.step_engine import StepEngine  # noqa: E402
from omni.models.hunyuan_image3.instruct_pipeline import HunyuanImage3InstructDistil  # noqa: E402
from omni.models.hunyuan_image3.tokenizer import Tokenizer  # noqa: E402
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig  # noqa: E402

GOAL_P50_S, GOAL_IMAGES_PER_HOUR = 1.5, 3000


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--quant", default="fp8_row")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--kv-gib", type=float, default=8.0)
    p.add_argument("--json", type=Path)
    return p.parse_args()


def build(platform, dev, a) -> StepEngine:
    cfg = dataclasses.replace(released_layers(a.layers), cfg_distilled=True, use_meanflow=True)
    model = build_random_model_layerwise(cfg, platform, quant=a.quant, paged=False, device=dev.device)
    with torch.device(dev.device):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae), with_encoder=False).eval()
    random_init_(vae)
    asset = resources.files("omni.models.hunyuan_image3.assets") / "tiny_instruct_tokenizer.json"
    tok = Tokenizer.from_file(Path(str(asset)))  # spells <guidance> / <timestep_r>; ids are valid released rows
    distil = HunyuanImage3InstructDistil(vision=None, transformer=model, vae=vae, tokenizer=tok, config=cfg,
                                         device=dev.device, vae_dtype=torch.bfloat16)
    pool = KVPool.from_budget(int(a.kv_gib * 2**30), num_layers=a.layers, page_size=256,
                              num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.bfloat16,
                              device=dev.device)
    return StepEngine(distil, pool=pool, runtime=SingleDevice(), device=dev.device, paged=False)


def requests(n: int, tag: str, a) -> list[ImageRequest]:
    return [ImageRequest(prompt="a red cat on green grass", height=a.size, width=a.size, steps=a.steps, guidance=5.0,
                         seed=i, template="instruct", request_id=f"{tag}{i}") for i in range(n)]


def _service(r) -> float:
    return r.times.conditioning + r.times.prefill + r.times.denoise + r.times.vae


def run(dev, engine, c: int, a) -> dict:
    dev.reset_peak_memory()
    dev.synchronize()
    t0 = time.perf_counter()
    results = Engine(engine, max_running=c).run(requests(a.requests, f"c{c}-", a))
    dev.synchronize()
    wall = time.perf_counter() - t0
    service = sorted(_service(r) for r in results)
    lat = sorted(r.times.queue + _service(r) for r in results)
    p50, p90 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.9 * len(lat)))]
    per_hour = len(results) / wall * 3600
    return {"concurrency": c, "requests": len(results), "wall_s": wall, "p50_s": p50, "p90_s": p90,
            "p50_service_s": service[len(service) // 2],  # admitted -> done: the queue wait left out
            "images_per_hour": per_hour, "peak_mem_gib": dev.max_memory_allocated() / 2**30,
            "mean_denoise_s": sum(r.times.denoise for r in results) / len(results),
            "mean_vae_s": sum(r.times.vae for r in results) / len(results),
            "goal_met": p50 <= GOAL_P50_S and per_hour >= GOAL_IMAGES_PER_HOUR}


def main() -> int:
    a = parse()
    commit = git_commit()
    platform = select(a.platform)
    dev = platform.device_services(0)
    engine = build(platform, dev, a)
    Engine(engine, max_running=2).run(requests(2, "warm", argparse.Namespace(**{**vars(a), "steps": 2})))
    rows = [run(dev, engine, int(c), a) for c in a.concurrency.split(",")]
    for r in rows:
        print(f"c={r['concurrency']}: p50 {r['p50_s']:.2f} s, {r['images_per_hour']:.0f} images/h, "
              f"peak {r['peak_mem_gib']:.1f} GiB, goal {'met' if r['goal_met'] else 'NOT met'}", file=sys.stderr)
    out = {"commit": commit, "platform": platform.name, "device": platform.info.device_name, "layers": a.layers,
           "quant": a.quant, "steps": a.steps, "size": a.size, "note": "random weights; eager; the real scheduler",
           "attention_kernel": engine.model.transformer.model.layers[0].self_attn.attn["none"].name, "results": rows}
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
