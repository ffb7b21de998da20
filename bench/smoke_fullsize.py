"""Full-size smoke: one 1024x1024 denoising step of the released shapes (random weights).

Runs the engine path exactly as serving does: a causal prefill of a ~300-token
prefix per CFG row into the paged KV pool, then timed denoising steps of
``<timestep>`` + 4096 image tokens per row (two rows packed), through the
platform's kernels. Prints time per step, per layer, peak memory; writes JSON.

    python bench/smoke_fullsize.py --platform cuda --layers 4 --json out.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit  # noqa: E402
from random_fullsize import build_random_model  # noqa: E402

from omni.kv_pool import KVPool, PoolContext, Run  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.models.hunyuan_image3.rope import rope_cos_sin  # noqa: E402
from omni.models.hunyuan_image3.sequence import rope_positions  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--layers", type=int, default=4, help="decoder layers to build (released has 32)")
    p.add_argument("--size", default="1024x1024", help="WxH; tokens = (H/16)*(W/16)")
    p.add_argument("--prefix", type=int, default=300, help="text prefix tokens per row")
    p.add_argument("--rows", type=int, default=2, help="2 = a CFG pair")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--quant", default="none")
    p.add_argument("--kv", choices=["paged", "contiguous"], default="paged")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def main() -> int:
    a = parse()
    platform = select(a.platform)
    dev = platform.device_services(0)
    w, h = (int(v) for v in a.size.split("x"))
    th, tw = h // 16, w // 16
    paged = a.kv == "paged"
    model = build_random_model(a.layers, platform, quant=a.quant, paged=paged, device=dev.device)
    cfg = model.cfg
    n_block = 1 + th * tw
    pool = KVPool(num_layers=a.layers, num_pages=a.rows * ((a.prefix + n_block) // 256 + 2), page_size=256,
                  num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.bfloat16, device=dev.device)
    pages = [tuple(pool.allocate(a.prefix + n_block)) for _ in range(a.rows)]
    pos = torch.tensor(rope_positions(a.prefix + n_block + 1, a.prefix + 1, th, tw), device=dev.device)
    cos, sin = (t.to(torch.bfloat16) for t in rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta))
    P = a.prefix

    @torch.inference_mode()
    def prefill():
        ids = torch.randint(0, 120000, (a.rows * P,), device=dev.device)
        ctx = PoolContext(pool, [Run(p, 0, P, P) for p in pages], "causal", paged, dev.device)
        model.backbone(model.embed_tokens(ids), cos[:P].repeat(a.rows, 1), sin[:P].repeat(a.rows, 1), ctx)

    latents = torch.randn(1, cfg.latent_channels, th, tw, device=dev.device, dtype=torch.bfloat16)
    runs = [r for p in pages for r in (Run(p, P, P + 1, P + 1), Run(p, P + 1, P + n_block, P + n_block))]
    ctx = PoolContext(pool, runs, "none", paged, dev.device)
    blk_cos, blk_sin = cos[P:P + n_block].repeat(a.rows, 1), sin[P:P + n_block].repeat(a.rows, 1)

    @torch.inference_mode()
    def step():
        t = torch.full((1,), 900.0, device=dev.device)
        x = torch.cat([model.timestep_token(t).to(torch.bfloat16), model.image_tokens(latents, t)[0]]).repeat(a.rows, 1)
        hid = model.backbone(x, blk_cos, blk_sin, ctx).view(a.rows, n_block, -1)
        return model.velocity(hid[:, 1:], t.repeat(a.rows), th, tw)

    @torch.inference_mode()
    def backbone_only(x):
        return model.backbone(x, blk_cos, blk_sin, ctx)

    prefill()
    dev.synchronize()
    t0 = time.perf_counter(); prefill(); dev.synchronize(); t_prefill = time.perf_counter() - t0
    for _ in range(2):
        step()
    dev.synchronize()
    dev.reset_peak_memory()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dev.synchronize()
    t_step = (time.perf_counter() - t0) / a.steps
    x = torch.randn(a.rows * n_block, cfg.hidden_size, device=dev.device, dtype=torch.bfloat16)
    backbone_only(x); dev.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        backbone_only(x)
    dev.synchronize()
    t_backbone = (time.perf_counter() - t0) / a.steps
    peak = dev.max_memory_allocated()
    out = {"platform": platform.name, "device": platform.info.device_name, "layers": a.layers, "size": a.size,
           "prefix": P, "rows": a.rows, "image_tokens_per_row": th * tw, "quant": a.quant, "kv": a.kv,
           "prefill_s": t_prefill, "step_s": t_step, "backbone_s": t_backbone,
           "per_layer_step_s": t_backbone / a.layers, "image_io_s": t_step - t_backbone,
           "extrapolated_32_layer_step_s": t_backbone / a.layers * 32 + (t_step - t_backbone),
           "peak_mem_gib": peak / 2**30,
           "attention_kernel": model.model.layers[0].self_attn.attn["none"].name}
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
