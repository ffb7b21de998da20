"""The reference answer to ``omni_glue_impl``: the memory-bound steps between a layer's GEMMs as torch ops.

This is what each fused glue kernel of a platform must compute (the
conformance suite compares them), and it is the model's own math: RMSNorm
normalises in fp32 and rounds to the activation dtype before the weight
multiplies (the official double rounding); RoPE (rotate-half, fp32 tables)
runs in fp32 and rounds; the QK-norm is that RMSNorm over ``head_dim``;
SwiGLU gates with the SECOND half; the router is a fp32 softmax, top-k,
renormalised to sum 1. Quantized outputs are ``omni.quant``'s per-row e4m3.
Runs on any device (plain torch ops), so it is the fallback of every
platform that has no fused glue; it is capturable where its device captures.

Shape suffixes: T tokens, D hidden, N query heads, K kv heads, H head dim,
I expert width, E experts, k experts per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quant
from .specs import GlueSpec, RowQuantized


def quantized_rows(y_TI: torch.Tensor) -> RowQuantized:
    """``y`` with its per-row e4m3 form (``omni.quant``)."""
    q, s = quant.quantize_fp8(y_TI, per_row=True)
    return RowQuantized(q, s, y_TI)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * round(x * rsqrt(mean(x^2) + eps))``: normalised in fp32, rounded to x's dtype, then weighted."""
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(x_TNH: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 with ``[T, H]`` tables, rounded to x's dtype."""
    x = x_TNH.float()
    return (x * cos_TH[:, None, :] + rotate_half(x) * sin_TH[:, None, :]).to(x_TNH.dtype)


def split_qkv(qkv_TO: torch.Tensor, heads_NK: tuple[int, int]):
    """The packed rows of KV group g are [q heads g*N/K .. (g+1)*N/K - 1, k head g, v head g]."""
    N, K = heads_NK
    T, H = qkv_TO.shape[0], qkv_TO.shape[1] // (N + 2 * K)  # explicit sizes: T may be 0 (an idle sp rank)
    qkv_TKGH = qkv_TO.view(T, K, N // K + 2, H)
    return qkv_TKGH[:, :, :-2].reshape(T, N, H), qkv_TKGH[:, :, -2], qkv_TKGH[:, :, -1]


class ReferenceGlue:
    """``GlueImpl`` as plain torch ops (see the module docstring)."""

    def __init__(self, spec: GlueSpec):
        self.spec, self.eps = spec, spec.eps
        self.name = "reference-glue"

    def rms_norm(self, x_TD, w_D, quantize: bool):
        y = rms_norm(x_TD, w_D, self.eps)
        return quantized_rows(y) if quantize else y

    def add_rms_norm(self, x_TD, d_TD, w_D, quantize: bool):
        h_TD = x_TD + d_TD
        return h_TD, self.rms_norm(h_TD, w_D, quantize)

    def rope_qk_norm(self, qkv_TO, cos_TH, sin_TH, wq_H, wk_H, heads_NK):
        q_TNH, k_TKH, v_TKH = split_qkv(qkv_TO, heads_NK)
        q_TNH = rms_norm(rope(q_TNH, cos_TH, sin_TH), wq_H, self.eps)
        k_TKH = rms_norm(rope(k_TKH, cos_TH, sin_TH), wk_H, self.eps)
        return q_TNH, k_TKH, v_TKH

    def swiglu(self, h_T2I, quantize: bool):
        x1, x2 = h_T2I.chunk(2, dim=-1)
        a = x1 * F.silu(x2)
        return quantized_rows(a) if quantize else a

    def route(self, logits_TE):
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        weights_Tk, experts_Tk = probs_TE.topk(self.spec.topk, dim=-1)
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return append_always_on(weights_Tk, experts_Tk, logits_TE.shape[-1], self.spec.always_on)


def append_always_on(weights_Tk: torch.Tensor, ids_Tk: torch.Tensor, num_experts: int, always_on: int):
    """The top-k columns followed by ``always_on`` columns of ids ``E, E + 1, ...`` with weight 1
    (``GlueSpec.always_on``: the shared expert as the routed experts' last group); unchanged when 0."""
    if not always_on:
        return weights_Tk, ids_Tk
    T = ids_Tk.shape[0]
    extra = torch.arange(num_experts, num_experts + always_on, device=ids_Tk.device, dtype=ids_Tk.dtype)
    return (torch.cat([weights_Tk, weights_Tk.new_ones(T, always_on)], dim=1),
            torch.cat([ids_Tk, extra.expand(T, always_on)], dim=1))
