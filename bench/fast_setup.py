"""bench_fast's model under test: one random full-size model, its KV pool with both CFG rows' prefixes
prefilled, and the constant tables of a 1024x1024 denoising step (its timer: ``bench_common.median_seconds``)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_fullsize import random_init_, released_layers  # noqa: E402

from omni.build_options import BuildOptions  # noqa: E402
from omni.kv_pool import KVPool, PoolContext, Run  # noqa: E402
from omni.models.hunyuan_image3.rope import rope_cos_sin  # noqa: E402
from omni.models.hunyuan_image3.sampler import cfg_combine, euler_step  # noqa: E402
from omni.models.hunyuan_image3.sequence import rope_positions  # noqa: E402
from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer  # noqa: E402

PEAK = {"bf16": 989.4e12, "fp8": 1978.9e12}  # H100/H200 SXM dense datasheet rates
RELEASED_LAYERS = 32


def bench_config(a):
    cfg = released_layers(a.layers)
    if a.config == "small":
        cfg = dataclasses.replace(cfg, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  attention_head_dim=64, num_experts=8, moe_intermediate_size=(128,) * a.layers)
    return cfg


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Setup:
    """One model, its KV pool with both rows' prefixes prefilled, and the constant step tables."""

    def __init__(self, a, platform, quant: str, device):
        self.a, self.device = a, device
        w, h = (int(v) for v in a.size.split("x"))
        self.th, self.tw = h // 16, w // 16
        self.n_block, self.P, self.rows = 1 + self.th * self.tw, a.prefix, 2
        cfg = self.cfg = bench_config(a)
        with torch.device(device):
            self.model = HunyuanImage3Transformer(cfg, platform, BuildOptions(
                dtype=torch.bfloat16, quant=quant, capturable=platform.info.accelerator,
                attn_fp8=a.attn_fp8 and quant != "none", fast_accum=a.fast_accum and quant != "none",
                grouped_fp8=a.grouped_fp8, shared_expert_stream=a.shared_stream, fuse_shared_expert=a.fuse_shared))
        random_init_(self.model, seed=0)  # same seed: the bf16 and fp8 models share their bf16 weights
        self.model.finalize()
        self.model.eval()
        L = self.P + self.n_block
        self.pool = KVPool(num_layers=a.layers, num_pages=self.rows * (L // 256 + 2), page_size=256,
                           num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.bfloat16,
                           device=device, store_gather=self.model.kv_store_gather)  # as build_pipeline's pool
        self.pages = [tuple(self.pool.allocate(L)) for _ in range(self.rows)]
        pos = torch.tensor(rope_positions(L + 1, self.P + 1, self.th, self.tw), device=device)
        self.cos, self.sin = (t.to(torch.bfloat16) for t in rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta))
        P = self.P
        self.runs = [r for p in self.pages for r in (Run(p, P, P + 1, P + 1), Run(p, P + 1, L, L))]
        self.blk_cos = self.cos[P:L].repeat(self.rows, 1)
        self.blk_sin = self.sin[P:L].repeat(self.rows, 1)
        g = torch.Generator(device=device).manual_seed(1)
        self.prefix_ids = torch.randint(0, 120000, (self.rows * P,), device=device, generator=g)
        self.latents = torch.randn(1, cfg.latent_channels, self.th, self.tw, device=device, generator=g)
        self.graphs = None

    def ctx(self):
        return PoolContext(self.pool, self.runs, "none", False, self.device)

    @property
    def graph_key(self) -> tuple:
        """``StepGraphs`` key of the step: (signature of both rows, their KV pages)."""
        return ((self.P, self.th, self.tw),) * self.rows, tuple(self.pages)

    @torch.inference_mode()
    def prefill(self):
        P, m = self.P, self.model
        ctx = PoolContext(self.pool, [Run(p, 0, P, P) for p in self.pages], "causal", False, self.device)
        m.backbone(m.embed_tokens(self.prefix_ids), self.cos[:P].repeat(self.rows, 1),
                   self.sin[:P].repeat(self.rows, 1), ctx)

    @torch.inference_mode()
    def block_input(self, t):
        m = self.model
        return torch.cat([m.timestep_token(t).to(torch.bfloat16),
                          m.image_tokens(self.latents.to(torch.bfloat16), t)[0]]).repeat(self.rows, 1)

    @torch.inference_mode()
    def step(self, graph: bool, latents=None):
        """One whole denoising step: embed, backbone, velocity, CFG combine, Euler update."""
        m, t = self.model, torch.full((1,), 900.0, device=self.device)
        x = self.block_input(t)
        if graph:
            h = self.graphs.run(self.graph_key, x, m.backbone, lambda: (self.blk_cos, self.blk_sin, self.ctx()))
        else:
            h = m.backbone(x, self.blk_cos, self.blk_sin, self.ctx())
        v = m.velocity(h.view(self.rows, self.n_block, -1)[:, 1:], t.repeat(self.rows), self.th, self.tw)
        v = cfg_combine(v[:1], v[1:], 5.0)
        return euler_step(self.latents if latents is None else latents, v, 0.9, 0.88), v

    @torch.inference_mode()
    def backbone(self, x):
        return self.model.backbone(x, self.blk_cos, self.blk_sin, self.ctx())
