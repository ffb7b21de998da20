"""bench_fast part (b): the naive step. The whole sequence (prefix + block) is recomputed every step with one
dense-masked SDPA and a per-expert Python loop, on the bf16 weights of the engine's model, with no prefix cache."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_seconds  # noqa: E402
from fast_setup import RELEASED_LAYERS, Setup  # noqa: E402

from omni.moe import swiglu  # noqa: E402
from omni.reference_glue import rms_norm, split_qkv  # noqa: E402
from omni.specs import PreparedWeight  # noqa: E402
from omni.models.hunyuan_image3.rope import apply_rope  # noqa: E402
from omni.models.hunyuan_image3.sampler import cfg_combine, euler_step  # noqa: E402


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

    t_step = median_seconds(step, max(3, a.timed // 3), warmup=1)
    t_bb = median_seconds(lambda: naive_step(s, x, cos, sin, mask), max(3, a.timed // 3), warmup=1)
    io = t_step - t_bb
    res = {"step_s": t_step, "backbone_s": t_bb, "per_layer_s": t_bb / a.layers, "image_io_s": io,
           "step_32_layers_s": t_bb / a.layers * RELEASED_LAYERS + io}
    out["naive_bf16"] = res
    print(f"[naive bf16] step {t_step*1e3:.1f} ms ({a.layers} layers), per layer {t_bb/a.layers*1e3:.2f} ms",
          flush=True)
