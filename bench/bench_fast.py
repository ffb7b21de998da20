"""Our engine against the naive path and the kernel floor, at full size, on one GPU.

Workload: one 1024x1024 image, 50 steps, CFG 5 (two rows), a ~300-token text
prefix per row, the released widths (hidden 4096, 32/8 heads of 128, 64
experts top-8 of width 3072 + a shared expert), RANDOM weights, ``--layers``
decoder layers; per-layer times are extrapolated to the released 32 layers
(the output says so). Per step: 2 x (``<timestep>`` + 4096 image tokens) =
8194 query tokens, each row attending to its prefix + its block.

  (a) engine   our path: prefix KV prefilled once, packed varlen step, fused MoE
               (``omni_moe_impl``), fp8 (``--quant``) and bf16, eager and graph-captured
               (``omni.step_graphs``); per step, per layer, per image (prefill + 50 steps + VAE decode)
  (b) naive    same bf16 weights: the whole sequence (prefix + block) recomputed every
               step with one dense-masked SDPA, a per-expert Python loop, no prefix cache
  (c) floor    the step's GEMMs (exact shapes, pre-quantized inputs, balanced experts) and
               its attention kernel, timed alone: time no implementation can beat by much

Also: a per-kernel breakdown of one engine step (torch.profiler), MFU against
the datasheet peaks (bf16 989 / fp8 1979 dense TFLOP/s), peak memory, and
FP8-vs-BF16 relative error of the step's prediction on these random layers.

    python bench/bench_fast.py --layers 4 --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import captured  # noqa: E402
from random_fullsize import random_init_, released_layers  # noqa: E402

from omni import quant as Q  # noqa: E402
from omni.build_options import BuildOptions  # noqa: E402
from omni.specs import GroupedGemmSpec, PreparedWeight  # noqa: E402
from omni.kv_pool import KVPool, PoolContext, Run, _meta  # noqa: E402
from omni.moe import swiglu  # noqa: E402
from omni.reference_glue import rms_norm, split_qkv  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.step_graphs import StepGraphs  # noqa: E402
from omni.models.hunyuan_image3.rope import apply_rope, rope_cos_sin  # noqa: E402
from omni.models.hunyuan_image3.sampler import cfg_combine, euler_step  # noqa: E402
from omni.models.hunyuan_image3.sequence import rope_positions  # noqa: E402
from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer  # noqa: E402

PEAK = {"bf16": 989.4e12, "fp8": 1978.9e12}  # H100/H200 SXM dense datasheet rates
RELEASED_LAYERS = 32
RANDOM_LAYERS_GATE = 0.12  # docs/quality.md: fp8_row vs bf16 backbone output, random full-size layers


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--steps", type=int, default=50, help="steps per image (for the per-image figure)")
    p.add_argument("--timed", type=int, default=10, help="timed steps per variant")
    p.add_argument("--quant", default="fp8_row")
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--attn-fp8", action="store_true", help="the fp8 engine also runs attention in e4m3 (attention.fp8)")
    p.add_argument("--fast-accum", action="store_true",
                   help="fp8 GEMMs accumulate without fp32 promotion (kernels.fp8_fast_accum), engine and floor")
    p.add_argument("--grouped-fp8", choices=["auto", "torch", "cutlass"], default="auto",
                   help="kernel of the fp8 expert GEMMs (kernels.grouped_fp8), engine and floor")
    p.add_argument("--shared-stream", action="store_true",
                   help="the engine runs each layer's shared expert on a side stream (kernels.shared_expert_stream)")
    p.add_argument("--fuse-shared", action="store_true", help="each layer's shared expert runs as the routed "
                   "experts' last group (kernels.fuse_shared_expert); the bf16 and fp8 engines alike")
    p.add_argument("--no-vae", action="store_true")
    p.add_argument("--vae-dtype", choices=["float32", "float16", "bfloat16"], default="float16",
                   help="the decode whose time enters the per-image figure (all three are timed and compared); "
                        "float16 autocast is the official pipeline's")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--json", type=Path)
    p.add_argument("--platform", default="cuda", help="cpu with --config small: a dry run of the script")
    p.add_argument("--config", choices=["released", "small"], default="released",
                   help="small: hidden 256, 4 experts (dry runs only)")
    return p.parse_args(argv)


def bench_config(a):
    cfg = released_layers(a.layers)
    if a.config == "small":
        cfg = dataclasses.replace(cfg, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=64,
                                  num_experts=8, moe_intermediate_size=(128,) * a.layers)
    return cfg


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, n: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``n`` runs, device events around each (host clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    sync()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    sync()
    return statistics.median(s.elapsed_time(e) for s, e in ev) / 1e3


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


def engine(a, platform, quant, device, out, label):
    s = Setup(a, platform, quant, device)
    sync()
    s.prefill()
    sync()
    t_prefill = timed(s.prefill, 3, warmup=1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_step_eager = timed(lambda: s.step(False), a.timed)
    x = s.block_input(torch.full((1,), 900.0, device=device))
    t_bb_eager = timed(lambda: s.backbone(x), a.timed)
    layer0 = s.model.model.layers[0]
    layer_bytes = sum(t.numel() * t.element_size() for t in list(layer0.parameters()) + list(layer0.buffers()))
    res = out[f"engine_{label}"] = {
        "quant": quant, "moe_kernel": layer0.mlp.experts.moe.name,
        "attention_kernel": layer0.self_attn.attn["none"].name, "linear_kernel": layer0.self_attn.qkv_proj.kernel.name,
        "prefill_s": t_prefill, "prefill_32_layers_s": t_prefill / a.layers * RELEASED_LAYERS,
        "step_eager_s": t_step_eager, "backbone_eager_s": t_bb_eager, "per_layer_eager_s": t_bb_eager / a.layers,
        "image_io_eager_s": t_step_eager - t_bb_eager,
        "step_32_layers_eager_s": t_bb_eager / a.layers * RELEASED_LAYERS + t_step_eager - t_bb_eager,
        "weight_bytes_per_layer": layer_bytes,
    }
    res.update(step_32_layers_s=res["step_32_layers_eager_s"], image_io_s=res["image_io_eager_s"], mode="eager")
    print(f"[engine {label}] eager: step {t_step_eager*1e3:.1f} ms ({a.layers} layers), per layer "
          f"{t_bb_eager/a.layers*1e3:.2f} ms, kernels {res['moe_kernel']} / {res['attention_kernel']}", flush=True)
    try:
        s.graphs = StepGraphs(platform, platform.info.device_type)
        s.step(True)
        t_step_graph = timed(lambda: s.step(True), a.timed)
        @torch.inference_mode()
        def replay_backbone():
            return s.graphs.run(s.graph_key, x, s.model.backbone, None)

        t_bb_graph = timed(replay_backbone, a.timed)
        io = t_step_graph - t_bb_graph
        res.update(step_graph_s=t_step_graph, backbone_graph_s=t_bb_graph, per_layer_graph_s=t_bb_graph / a.layers,
                   image_io_s=io, step_32_layers_s=t_bb_graph / a.layers * RELEASED_LAYERS + io, mode="graph",
                   captures=s.graphs.captures, replays=s.graphs.replays)
        print(f"[engine {label}] graph: step {t_step_graph*1e3:.1f} ms, per layer {t_bb_graph/a.layers*1e3:.2f} ms, "
              f"image io {io*1e3:.1f} ms", flush=True)
    except Exception as err:
        out.setdefault("errors", {})[f"graph_{label}"] = f"{type(err).__name__}: {err}"
        print(f"[engine {label}] graph capture FAILED, eager figures stand: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc()
        s.graphs = None
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    kv_layer = s.pool.k[0].numel() * s.pool.k[0].element_size() * 2
    res["peak_mem_gib_measured_layers"] = peak / 2**30
    res["peak_mem_gib_32_layers_estimate"] = (peak + (RELEASED_LAYERS - a.layers) * (layer_bytes + kv_layer)) / 2**30
    print(f"[engine {label}] peak {peak/2**30:.1f} GiB with {a.layers} layers; ~{res['peak_mem_gib_32_layers_estimate']:.1f}"
          f" GiB estimated for 32 (+ weights and KV of the other layers)", flush=True)
    return s, res


# ----------------------------------------------------------------- (b) naive


@torch.inference_mode()
def fp32_weight(wg) -> torch.Tensor:
    """The router's fp32 ``[E, D]`` weight, also from a kernel's prepared form (the cuda split: ``fp32_weight``)."""
    recombine = getattr(wg.kernel, "fp32_weight", None)
    return wg.weight.float() if recombine is None else recombine(PreparedWeight(wg.weight))


def naive_step(s: Setup, x_BLD, cos_BLH, sin_BLH, mask_LL):
    """Full sequence every step, dense-masked SDPA, per-expert loop (bf16 weights of ``s.model``)."""
    B, L, D = x_BLD.shape
    h = x_BLD
    cos, sin = cos_BLH.flatten(0, 1), sin_BLH.flatten(0, 1)
    for layer in s.model.model.layers:
        at = layer.self_attn
        xn = layer.input_layernorm(h).flatten(0, 1)
        q, k, v = split_qkv(F.linear(xn, at.qkv_proj.weight), at.shape_NKH[:2])
        q = rms_norm(apply_rope(q, cos, sin), at.query_layernorm.weight, at.query_layernorm.eps)
        k = rms_norm(apply_rope(k, cos, sin), at.key_layernorm.weight, at.key_layernorm.eps)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (t.reshape(B, L, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_LL)
        h = h + F.linear(o.transpose(1, 2).flatten(2), at.o_proj.weight)
        mlp = layer.mlp
        xn = layer.post_attention_layernorm(h).flatten(0, 1)
        probs = torch.softmax(F.linear(xn.float(), fp32_weight(mlp.gate.wg)), -1)
        wts, ids = probs.topk(mlp.gate.topk, -1)
        wts = wts / wts.sum(-1, keepdim=True)
        sh = mlp.shared_mlp
        y = F.linear(swiglu(F.linear(xn, sh.gate_and_up_proj.weight)), sh.down_proj.weight).float()
        w13, w2 = mlp.experts.gate_and_up_proj.weight, mlp.experts.down_proj.weight
        for e in range(w13.shape[0]):
            tok, j = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                ye = F.linear(swiglu(F.linear(xn[tok], w13[e])), w2[e])
                y.index_add_(0, tok, ye.float() * wts[tok, j][:, None])
        h = h + y.to(h.dtype).view(B, L, D)
    return h


def naive(a, s: Setup, out):
    P, L, dev = s.P, s.P + s.n_block, s.device
    i = torch.arange(L, device=dev)
    mask = (i[None, :] <= i[:, None]) | ((i[:, None] > P) & (i[None, :] > P))  # generalized causal
    t = torch.full((1,), 900.0, device=dev)
    with torch.inference_mode():
        prefix = s.model.embed_tokens(s.prefix_ids).view(s.rows, P, -1)
        x = torch.cat([prefix, s.block_input(t).view(s.rows, s.n_block, -1)], 1)
    cos, sin = s.cos[:L].expand(s.rows, L, -1), s.sin[:L].expand(s.rows, L, -1)

    def step():
        with torch.inference_mode():
            xb = torch.cat([prefix, s.block_input(t).view(s.rows, s.n_block, -1)], 1)
            h = naive_step(s, xb, cos, sin, mask)
            v = s.model.velocity(h[:, P + 1:], t.repeat(s.rows), s.th, s.tw)
            return euler_step(s.latents, cfg_combine(v[:1], v[1:], 5.0), 0.9, 0.88)

    t_step = timed(step, max(3, a.timed // 3), warmup=1)
    t_bb = timed(lambda: naive_step(s, x, cos, sin, mask), max(3, a.timed // 3), warmup=1)
    io = t_step - t_bb
    res = {"step_s": t_step, "backbone_s": t_bb, "per_layer_s": t_bb / a.layers, "image_io_s": io,
           "step_32_layers_s": t_bb / a.layers * RELEASED_LAYERS + io}
    out["naive_bf16"] = res
    print(f"[naive bf16] step {t_step*1e3:.1f} ms ({a.layers} layers), per layer {t_bb/a.layers*1e3:.2f} ms", flush=True)


# ----------------------------------------------------------------- (c) floor


def step_flops(cfg, T: int, keys_per_query: list[int]) -> dict:
    """FLOPs of one layer's GEMMs and attention for T packed tokens (2 per multiply-add)."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inner, k, E = cfg.moe_intermediate_size[0], cfg.moe_topk[0], cfg.num_experts
    shared = inner * cfg.num_shared_expert[0]
    dense = 2 * T * (D * (N + 2 * K) * H + N * H * D + D * 2 * shared + shared * D + D * E)
    routed = 2 * T * k * (D * 2 * inner + inner * D)
    attn = sum(4 * N * H * lk for lk in keys_per_query)
    return {"dense": dense, "routed": routed, "attention": attn, "total": dense + routed + attn}


def floor(a, s: Setup, out, platform):
    cfg, dev = s.cfg, s.device
    T = s.rows * s.n_block
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inner, k, E = cfg.moe_intermediate_size[0], cfg.moe_topk[0], cfg.num_experts
    dense_shapes = {"qkv": ((N + 2 * K) * H, D), "o_proj": (D, N * H), "shared_gate_up": (2 * inner, D),
                    "shared_down": (D, inner), "router": (E, D)}
    R = T * k
    sizes = [R // E + (1 if e < R % E else 0) for e in range(E)]
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    g = torch.Generator(device=dev).manual_seed(2)
    res = {}
    for prec in ("bf16", "fp8"):
        times, kept = {}, {}

        def time_kernel(name, fn):
            times[name] = timed(fn, 20)
            if prec == "fp8":
                kept[name] = fn  # with its operands: replayed back to back below

        for name, (o, i) in dense_shapes.items():
            x = torch.randn(T, i, device=dev, generator=g, dtype=torch.bfloat16)
            w = torch.randn(o, i, device=dev, generator=g, dtype=torch.bfloat16)
            if prec == "bf16" or name == "router":
                time_kernel(name, lambda x=x, w=w: x @ w.t())
            else:
                xq, xs = Q.quantize_fp8(x, True)
                wq, ws = Q.quantize_fp8(w, True)
                time_kernel(name, lambda xq=xq, xs=xs, wq=wq, ws=ws: torch._scaled_mm(
                    xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16,
                    use_fast_accum=a.fast_accum))
        for name, (o, i) in {"experts_gate_up": (2 * inner, D), "experts_down": (D, inner)}.items():
            x = torch.randn(R, i, device=dev, generator=g, dtype=torch.bfloat16)
            w = torch.randn(E, o, i, device=dev, generator=g, dtype=torch.bfloat16)
            if prec == "bf16":
                time_kernel(name, lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16))
            else:  # the engine's own grouped kernel (kernels.grouped_fp8 resolves it), on the same operands
                kernel = platform.grouped_gemm(GroupedGemmSpec(
                    num_experts=E, in_features=i, out_features=o, dtype=torch.bfloat16, quant="fp8_row",
                    fast_accum=a.fast_accum, grouped_fp8=a.grouped_fp8))
                xq, xs = Q.quantize_fp8(x, True)
                pw = kernel.prepare_weight(w)
                pre_quantized = getattr(kernel, "scaled", None)  # the cuda kernels take e4m3 rows (the reference: x)
                time_kernel(name, (lambda xq=xq, xs=xs, pw=pw: pre_quantized(xq, xs, pw, offs)) if pre_quantized
                            else (lambda x=x, pw=pw: kernel(x, pw, offs)))
                res.setdefault("grouped_kernel", kernel.name)
            x = w = None  # free the bf16 operands before the next shape (the kept fp8 kernels hold their own)
        attn = s.model.model.layers[0].self_attn.attn["none"]
        meta = _meta(s.runs, False, dev)
        S = meta.cu_seqlens_k_host[-1]
        q = torch.randn(T, N, H, device=dev, generator=g, dtype=torch.bfloat16)
        kk = torch.randn(S, K, H, device=dev, generator=g, dtype=torch.bfloat16)
        vv = torch.randn(S, K, H, device=dev, generator=g, dtype=torch.bfloat16)
        time_kernel("attention", lambda: attn(q, kk, vv, meta))
        total = sum(times.values())
        res[prec] = {"per_layer_s": total, "kernels_s": times,
                     "step_32_layers_s": total * RELEASED_LAYERS,
                     "image_s": total * RELEASED_LAYERS * a.steps}
        print(f"[floor {prec}] per layer {total*1e3:.2f} ms: " +
              ", ".join(f"{n} {t*1e3:.2f}" for n, t in times.items()), flush=True)
        if kept and torch.cuda.is_available():
            res[prec]["sustained"] = sustained_floor(kept, a.timed)
            kept.clear()
    keys = [lk for b in range(meta.num_seqs) for lk in
            [meta.cu_seqlens_k_host[b + 1] - meta.cu_seqlens_k_host[b]] *
            (meta.cu_seqlens_q_host[b + 1] - meta.cu_seqlens_q_host[b])]
    fl = step_flops(cfg, T, keys)
    res["flops_per_layer"] = fl
    for prec in ("bf16", "fp8"):
        kt = res[prec]["kernels_s"]
        gemm_t = sum(v for n, v in kt.items() if n != "attention")
        res[prec]["gemm_tflops"] = (fl["dense"] + fl["routed"]) / gemm_t / 1e12
        res[prec]["attention_tflops"] = fl["attention"] / kt["attention"] / 1e12
    out["floor"] = res


def sustained_floor(kernels: dict, steps: int) -> dict:
    """The floor's kernels of one layer captured into one graph and replayed back to back, 32 layers a step,
    as the engine runs them: the clocks of sustained running under the power cap, which the kernels timed
    alone (a short burst each) do not see. Same kernels, same operands; only the running conditions differ."""
    graph = captured(lambda: [fn() for fn in kernels.values()])
    layer_s = timed(lambda: [graph.replay() for _ in range(RELEASED_LAYERS)], steps, warmup=3) / RELEASED_LAYERS
    print(f"[floor sustained] per layer {layer_s*1e3:.2f} ms (one graph of {len(kernels)} kernels, replayed "
          f"{RELEASED_LAYERS} times a step)", flush=True)
    return {"per_layer_s": layer_s, "step_32_layers_s": layer_s * RELEASED_LAYERS}


# ----------------------------------------------------------------- breakdown, quality, VAE


def profile(s: Setup, out, label, graph: bool = False):
    """Kernel time per layer by kernel and category: one eager backbone pass, or (``graph``) two replays of the
    captured backbone right after its timed loop (the clocks of sustained running), with the replays' wall
    time beside the kernel sum: what is left between them is idle time between kernels, not clocks."""
    from torch.profiler import ProfilerActivity, profile as prof

    x = s.block_input(torch.full((1,), 900.0, device=s.device))
    passes = 2 if graph else 1

    @torch.inference_mode()
    def run():
        return s.graphs.run(s.graph_key, x, s.model.backbone, None) if graph else s.backbone(x)

    run()
    sync()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        wall_ms = timed(lambda: [run() for _ in range(passes)], 1, warmup=0) * 1e3 / passes / s.a.layers
    rows = []
    for ev in p.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.key and not ev.key.startswith(("cudaLaunch", "cudaStream")):
            rows.append((ev.key, t / 1e3 / s.a.layers / passes, ev.count // s.a.layers // passes))
    rows = sorted({r[0]: r for r in rows}.values(), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)

    def cat(name):
        n = name.lower()
        if "flash" in n or "fmha" in n or "attn" in n:
            return "attention"
        if any(w in n for w in ("gemm", "cutlass", "nvjet", "sm90", "xmma", "matmul", "_mm")):
            return "gemm"
        if "triton" in n or n.startswith("_"):
            return "triton"
        return "other (norm, rope, routing, copies, casts)"

    cats: dict[str, float] = {}
    for name, ms, _ in rows:
        cats[cat(name)] = cats.get(cat(name), 0.0) + ms
    out[f"kernels_{label}"] = {"mode": "graph replay" if graph else "eager", "per_layer_ms_total": total,
                               "per_layer_wall_ms": wall_ms, "by_category_ms": cats,
                               "top": [{"kernel": n[:120], "ms_per_layer": m, "calls_per_layer": c}
                                       for n, m, c in rows[:40]]}
    print(f"[kernels {label}] per layer {total:.2f} ms of kernel time in {wall_ms:.2f} ms of wall time "
          f"({'graph replay' if graph else 'eager'}): " + ", ".join(f"{k} {v:.2f}" for k, v in cats.items()), flush=True)
    for n, m, c in rows[:12]:
        print(f"    {m:7.3f} ms  x{c:<3d} {n[:100]}", flush=True)


def profile_io(s: Setup, out, label):
    """The step outside the backbone (patch embed + timestep token; final layer, CFG combine, Euler):
    wall time against the sum of its kernels and their count, per part. Where the model keeps NHWC conv
    weights (the platform's channels_last capability) it is measured again with NCHW copies of them (the
    baseline), and the same weight tensors go back afterwards (captured graphs point at them)."""
    io_parts(s, out, label)
    if not s.model.channels_last:
        return
    convs = [c for head in (s.model.patch_embed, s.model.final_layer) for c in head.modules()
             if isinstance(c, torch.nn.Conv2d)]
    kept = [c.weight.data for c in convs]
    for c, w in zip(convs, kept):
        c.weight.data = w.contiguous()
    try:
        io_parts(s, out, f"{label}_nchw_weights")
    finally:
        for c, w in zip(convs, kept):
            c.weight.data = w


def io_parts(s: Setup, out, label):
    from torch.profiler import ProfilerActivity, profile as prof

    m, t = s.model, torch.full((1,), 900.0, device=s.device)
    h = torch.randn(s.rows * s.n_block, s.cfg.hidden_size, device=s.device, dtype=torch.bfloat16)

    @torch.inference_mode()
    def tail():
        v = m.velocity(h.view(s.rows, s.n_block, -1)[:, 1:], t.repeat(s.rows), s.th, s.tw)
        return euler_step(s.latents, cfg_combine(v[:1], v[1:], 5.0), 0.9, 0.88)

    res = out[f"image_io_{label}"] = {}
    for name, fn in (("block_input", lambda: s.block_input(t)), ("velocity_cfg_euler", tail)):
        wall = timed(fn, 20)
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            fn()
            sync()
        evs = [(ev.key, getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0), ev.count)
               for ev in p.key_averages()]
        evs = [e for e in evs if e[1] > 0 and not e[0].startswith(("cudaLaunch", "cudaStream"))]
        kern = sum(e[1] for e in evs) / 1e3
        res[name] = {"wall_ms": wall * 1e3, "kernel_ms": kern, "launches": sum(e[2] for e in evs),
                     "top": [{"kernel": k[:100], "ms": v / 1e3, "calls": c} for k, v, c in
                             sorted(evs, key=lambda e: -e[1])[:10]]}
        print(f"[image io {label}] {name}: wall {wall*1e3:.2f} ms, kernels {kern:.2f} ms in "
              f"{res[name]['launches']} launches", flush=True)
        for k, v, c in sorted(evs, key=lambda e: -e[1])[:8]:
            print(f"    {v/1e3:7.3f} ms  x{c:<3d} {k[:100]}", flush=True)


def quality(s16: Setup, s8: Setup, out):
    t = torch.full((1,), 900.0, device=s16.device)
    with torch.inference_mode():
        x = s16.block_input(t)
        h16, h8 = s16.backbone(x), s8.backbone(x)
        _, v16 = s16.step(False)
        _, v8 = s8.step(False)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    q = {"backbone_delta_rel_err": rel(h8 - x, h16 - x), "backbone_rel_err": rel(h8, h16),
         "prediction_rel_err": rel(v8, v16), "gate_backbone_rel_err_max": RANDOM_LAYERS_GATE}
    q["gate"] = "pass" if q["backbone_rel_err"] <= RANDOM_LAYERS_GATE else "FAIL"
    out["quality_random_layers"] = q
    print(f"[quality] fp8 vs bf16 on {s16.a.layers} random full-size layers: " +
          json.dumps(out["quality_random_layers"]), flush=True)


VAE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_pixels(x_B3HW: torch.Tensor) -> torch.Tensor:
    """The pipeline's denormalisation: [-1, 1] -> uint8 levels (as floats, for differences)."""
    return ((x_B3HW / 2 + 0.5).clamp(0, 1) * 255).round()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0 ** 2 / mse)).item()


def vae_decode(s: Setup, out, per_image: str):
    """1024x1024 decode in fp32 and under fp16 / bf16 autocast (the official pipeline's is fp16); each
    low-precision image is compared with the fp32 one in uint8 levels. ``per_image`` enters the image figure."""
    from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig

    with torch.device(s.device):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(s.cfg.vae)).eval()
    random_init_(vae, 0)
    vae.prepare(channels_last=s.model.channels_last, group_norm_kernel=s.model.group_norm_kernel)  # as the engine
    lat = s.latents.float()
    ref = to_pixels(vae.decode_image(lat, dtype=torch.float32))
    res = {}
    for name, dtype in VAE_DTYPES.items():
        t = timed(lambda: vae.decode_image(lat, dtype=dtype), 3, warmup=1)
        px = to_pixels(vae.decode_image(lat, dtype=dtype))
        res[name] = {"s": t, "finite": bool(px.isfinite().all()), "psnr_vs_fp32_db": psnr(px, ref),
                     "max_level_diff": float((px - ref).abs().max()),
                     "levels_off_by_more_than_2_frac": float(((px - ref).abs() > 2).float().mean())}
        print(f"[vae] decode 1024x1024 {name}: {t*1e3:.1f} ms, vs fp32 {json.dumps(res[name])}", flush=True)
    out["vae_decode"] = res
    out["vae_decode_dtype"] = per_image
    out["vae_decode_s"] = res[per_image]["s"]
    vae = None  # frees the VAE before the caller's next part


def main():
    a = parse()
    platform = select(a.platform)
    dev = platform.device_services(0).device
    out = {"note": f"RANDOM weights, released widths, {a.layers} of 32 layers measured; per-layer times x 32 "
                   f"(+ per-step image I/O) give the 32-layer figures",
           "device": platform.info.device_name, "torch": torch.__version__, "layers": a.layers, "size": a.size,
           "prefix": a.prefix, "rows": 2, "steps": a.steps, "cfg": 5.0,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}

    def save():
        if a.json:
            a.json.write_text(json.dumps(out, indent=2))

    def attempt(name, fn):
        try:
            return fn()
        except Exception as err:  # a part that fails is reported, the rest still runs
            out.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
            print(f"[{name}] FAILED: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc()
        finally:
            save()

    s8, _ = attempt("engine_fp8", lambda: engine(a, platform, a.quant, dev, out, "fp8")) or (None, None)
    if s8 is not None and not a.no_profile:
        if s8.graphs is not None:
            attempt("profile_fp8_graph", lambda: profile(s8, out, "fp8_graph", graph=True))
        attempt("profile_fp8", lambda: profile(s8, out, "fp8"))
        attempt("profile_io_fp8", lambda: profile_io(s8, out, "fp8"))
    s16, _ = attempt("engine_bf16", lambda: engine(a, platform, "none", dev, out, "bf16")) or (None, None)
    if s16 is not None and not a.no_profile:
        attempt("profile_bf16", lambda: profile(s16, out, "bf16"))
    if s8 is not None and s16 is not None:
        attempt("quality", lambda: quality(s16, s8, out))
    if s8 is not None:
        s8.graphs = None
        attempt("floor", lambda: floor(a, s8, out, platform))
    s8 = None  # frees the fp8 model before the naive bf16 run
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if s16 is not None and not a.no_naive:
        s16.graphs = None
        attempt("naive", lambda: naive(a, s16, out))
    if not a.no_vae and s16 is not None:
        attempt("vae", lambda: vae_decode(s16, out, a.vae_dtype))
    summarize(a, out)
    save()


def summarize(a, out):
    vae = out.get("vae_decode_s", 0.0)
    lines = [f"== {out['device']}, {a.size}, {a.steps} steps, CFG 5, prefix {a.prefix}; RANDOM weights; "
             f"{a.layers} layers measured, extrapolated to 32 =="]
    fl = out.get("floor", {})
    flops_step = fl.get("flops_per_layer", {}).get("total", 0) * RELEASED_LAYERS
    summary = {}
    for key, label in (("engine_fp8", "engine fp8"), ("engine_bf16", "engine bf16"), ("naive_bf16", "naive bf16")):
        r = out.get(key)
        if not r:
            continue
        step = r.get("step_32_layers_s")
        prefill = r.get("prefill_32_layers_s", 0.0)
        image = prefill + a.steps * step + vae
        summary[key] = {"step_32_s": step, "image_s": image}
        mfu = ""
        if flops_step:
            prec = "fp8" if key == "engine_fp8" else "bf16"
            mfu = f", {flops_step / (step - r.get('image_io_s', 0)) / 1e12:.0f} TFLOP/s in the backbone " \
                  f"(MFU {flops_step / (step - r.get('image_io_s', 0)) / PEAK[prec] * 100:.0f}% of {prec} peak)"
        lines.append(f"{label:12s}: step {step*1e3:7.1f} ms, image {image:6.2f} s{mfu}")
    for prec in ("fp8", "bf16"):
        if prec in fl:
            f = fl[prec]
            lines.append(f"floor {prec:5s}: step {f['step_32_layers_s']*1e3:7.1f} ms, image {f['image_s']:6.2f} s "
                         f"(GEMMs {f['gemm_tflops']:.0f} TFLOP/s, attention {f['attention_tflops']:.0f} TFLOP/s)")
    e8, nv = summary.get("engine_fp8"), summary.get("naive_bf16")
    if e8 and nv:
        lines.append(f"naive / engine fp8 = {nv['image_s'] / e8['image_s']:.1f}x")
    if e8 and "fp8" in fl:
        lines.append(f"engine fp8 / floor fp8 = {e8['step_32_s'] / fl['fp8']['step_32_layers_s']:.2f}x (per step)")
        sus = fl["fp8"].get("sustained")
        if sus:
            lines.append(f"engine fp8 / sustained floor fp8 = {e8['step_32_s'] / sus['step_32_layers_s']:.2f}x "
                         f"(floor kernels replayed back to back: {sus['step_32_layers_s']*1e3:.1f} ms a step)")
    e16 = summary.get("engine_bf16")
    if e16 and "bf16" in fl:
        lines.append(f"engine bf16 / floor bf16 = {e16['step_32_s'] / fl['bf16']['step_32_layers_s']:.2f}x (per step)")
    lines.append(f"VAE decode ({out.get('vae_decode_dtype', '-')}) {vae*1e3:.0f} ms included per image; peak memory "
                 f"{out.get('engine_fp8', {}).get('peak_mem_gib_measured_layers', float('nan')):.1f} GiB "
                 f"({a.layers} layers, fp8)")
    out["summary"] = summary
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
