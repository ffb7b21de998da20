"""Triton kernels of the CUDA glue (``omni_glue_impl``): one pass per step instead of a chain of torch ops.

May assume: ``triton`` imports (``glue.py`` imports this module only then) and
rows are contiguous CUDA tensors whose last dim is the reduced one. Every
kernel reproduces the reference's roundings (``omni.reference_glue``): the
normalised value is rounded to the activation dtype before the weight
multiplies, RoPE output is rounded before its QK-norm; the e4m3 quantization
is ``omni.quant``'s (absmax / 448 from the rounded row, clamp, round).

    norm_kernel      [h = x + d]  ->  y = w * round(h * rsqrt(mean(h^2) + eps))  [-> e4m3 rows + scales]
    rope_norm_kernel per (token, KV group): the group's q heads and its k head rotated (rotate-half)
                     and RMSNormed over H; q, k and v written contiguously
    route_kernel     per block of tokens: fp32 softmax over E, top-k by repeated arg-max, renormalised
"""
from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _round(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit
def norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, q_ptr, s_ptr, D, eps, BLOCK: tl.constexpr,
                ADD: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + r * D + cols, mask=m, other=0.0).to(tl.float32)
    if ADD:  # the residual add rounds in the activation dtype, as ``x + d`` does
        x = _round(x + tl.load(d_ptr + r * D + cols, mask=m, other=0.0).to(tl.float32), dt)
        tl.store(h_ptr + r * D + cols, x.to(dt), mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = _round(w * _round(x * inv, dt), dt)
    tl.store(y_ptr + r * D + cols, y.to(dt), mask=m)
    if QUANT:
        s = tl.maximum(tl.max(tl.abs(y), axis=0) / QMAX, 1e-12)
        q = tl.minimum(tl.maximum(y / s, -QMAX), QMAX)
        tl.store(q_ptr + r * D + cols, q.to(tl.float8e4nv), mask=m)
        tl.store(s_ptr + r, s)


@triton.jit
def _rope_norm_head(x1, x2, c, s, w1, w2, eps, H: tl.constexpr, dt: tl.constexpr):
    """One head's halves: rotate-half RoPE (rounded), then RMSNorm over H (rounded, weighted, rounded)."""
    y1 = _round(x1 * c - x2 * s, dt)
    y2 = _round(x2 * c + x1 * s, dt)
    inv = 1.0 / tl.sqrt((tl.sum(y1 * y1, axis=0) + tl.sum(y2 * y2, axis=0)) / H + eps)
    return _round(w1 * _round(y1 * inv, dt), dt), _round(w2 * _round(y2 * inv, dt), dt)


@triton.jit
def rope_norm_kernel(qkv_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, q_ptr, k_ptr, v_ptr, eps,
                     K: tl.constexpr, G: tl.constexpr, H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    HALF: tl.constexpr = H // 2
    lo = tl.arange(0, HALF)
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + t * H + lo)  # the tables repeat their halves: cos[i] == cos[i + H/2]
    s = tl.load(sin_ptr + t * H + lo)
    wq1, wq2 = tl.load(wq_ptr + lo).to(tl.float32), tl.load(wq_ptr + HALF + lo).to(tl.float32)
    row = qkv_ptr + t * (K * (G + 2) * H) + g * (G + 2) * H
    for j in tl.static_range(G):  # this group's query heads
        x1 = tl.load(row + j * H + lo).to(tl.float32)
        x2 = tl.load(row + j * H + HALF + lo).to(tl.float32)
        y1, y2 = _rope_norm_head(x1, x2, c, s, wq1, wq2, eps, H, dt)
        out = q_ptr + (t * K * G + g * G + j) * H
        tl.store(out + lo, y1.to(dt))
        tl.store(out + HALF + lo, y2.to(dt))
    wk1, wk2 = tl.load(wk_ptr + lo).to(tl.float32), tl.load(wk_ptr + HALF + lo).to(tl.float32)
    x1 = tl.load(row + G * H + lo).to(tl.float32)
    x2 = tl.load(row + G * H + HALF + lo).to(tl.float32)
    y1, y2 = _rope_norm_head(x1, x2, c, s, wk1, wk2, eps, H, dt)
    kout = k_ptr + (t * K + g) * H
    tl.store(kout + lo, y1.to(dt))
    tl.store(kout + HALF + lo, y2.to(dt))
    vout = v_ptr + (t * K + g) * H
    tl.store(vout + lo, tl.load(row + (G + 1) * H + lo))
    tl.store(vout + HALF + lo, tl.load(row + (G + 1) * H + HALF + lo))


@triton.jit
def route_kernel(logits_ptr, w_ptr, ids_ptr, T, E, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, KPAD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rm, cm = rows < T, cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :], mask=rm[:, None] & cm[None, :],
                other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(cm[None, :], p, -1.0)
    kcols = tl.arange(0, KPAD)
    wk = tl.zeros([BLOCK_T, KPAD], dtype=tl.float32)
    ik = tl.zeros([BLOCK_T, KPAD], dtype=tl.int32)
    for j in tl.static_range(TOPK):  # repeated arg-max: the lowest index wins a tie
        best = tl.max(p, axis=1)
        idx = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        wk = tl.where(kcols[None, :] == j, best[:, None], wk)
        ik = tl.where(kcols[None, :] == j, idx[:, None], ik)
        p = tl.where(cols[None, :] == idx[:, None], -1.0, p)
    wk = wk / tl.sum(wk, axis=1)[:, None]
    km = rm[:, None] & (kcols[None, :] < TOPK)
    off = rows[:, None].to(tl.int64) * TOPK + kcols[None, :]
    tl.store(w_ptr + off, wk, mask=km)
    tl.store(ids_ptr + off, ik.to(tl.int64), mask=km)
