"""Triton kernels of the CUDA glue (``omni_glue_impl``): one pass per step instead of a chain of torch ops.

May assume: ``triton`` imports (``glue.py`` imports this module only then) and
rows are contiguous CUDA tensors whose last dim is the reduced one. Every
kernel reproduces the reference's roundings (``omni.reference_glue``): the
normalised value is rounded to the activation dtype before the weight
multiplies, RoPE output is rounded before its QK-norm; the e4m3 quantization
is ``omni.quant``'s (absmax / 448 from the rounded row, clamp, round).

    norm_kernel      [h = x + d]  ->  y = w * round(h * rsqrt(mean(h^2) + eps))  [-> e4m3 rows + scales]
    rope_norm_kernel per (block of tokens, KV group): the group's q heads and its k head rotated
                     (rotate-half) and RMSNormed over H; q, k and v written contiguously
    route_kernel     per block of tokens: fp32 softmax over E, top-k by repeated arg-max, renormalised
    kv_kernel        a forward's K/V stored at their pool slots and the key table gathered, in one launch:
                     key rows written in this forward are read from the new rows, not the pool

Each program takes ``ROWS`` rows (tokens) at once; ``TILES`` holds the rows per program and warps the
platform launches with, chosen by ``bench/bench_row_kernels.py`` on an H200 (BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .pdl_triton import wait_for_predecessor

FP8_MAX = 448.0


@dataclass(frozen=True)
class Tile:
    """How a row kernel is launched: rows (tokens) per program and warps per program."""

    rows: int
    warps: int


# Chosen by bench/bench_row_kernels.py on an H200 at the released shapes (BENCHMARKS.md, "Seventh session"):
# us before -> after: norm 106 / 156 (rms / add + rms) -> 106 / 141, rope 180 -> 94, route 65 -> 40,
# the shared expert's SwiGLU 92.5 -> 73.2 (the routed rows' SwiGLU keeps TritonKernels.swiglu_tile).
TILES = {"norm": Tile(2, 8), "rope": Tile(4, 1), "route": Tile(8, 2), "swiglu": Tile(1, 16)}


@triton.jit
def _round(x, dtype: tl.constexpr):
    return x.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["T"])
def norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, q_ptr, s_ptr, T, D, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                ADD: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    wait_for_predecessor(PDL, TRIGGER)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    rm, cm = rows < T, cols < D
    m = rm[:, None] & cm[None, :]
    off = rows[:, None] * D + cols[None, :]
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    if ADD:  # the residual add rounds in the activation dtype, as ``x + d`` does
        x = _round(x + tl.load(d_ptr + off, mask=m, other=0.0).to(tl.float32), dt)
        tl.store(h_ptr + off, x.to(dt), mask=m)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    y = _round(w[None, :] * _round(x * inv[:, None], dt), dt)
    tl.store(y_ptr + off, y.to(dt), mask=m)
    if QUANT:
        s = tl.maximum(tl.max(tl.abs(y), axis=1) / QMAX, 1e-12)
        q = tl.minimum(tl.maximum(y / s[:, None], -QMAX), QMAX)
        tl.store(q_ptr + off, q.to(tl.float8e4nv), mask=m)
        tl.store(s_ptr + rows, s, mask=rm)


@triton.jit
def _rope_norm_head(x1, x2, c, s, w1, w2, eps, H: tl.constexpr, dt: tl.constexpr):
    """Each token's head halves ``[tokens, H/2]``: rotate-half RoPE (rounded), then RMSNorm over H (rounded,
    weighted, rounded)."""
    y1 = _round(x1 * c - x2 * s, dt)
    y2 = _round(x2 * c + x1 * s, dt)
    inv = 1.0 / tl.sqrt((tl.sum(y1 * y1, axis=1) + tl.sum(y2 * y2, axis=1)) / H + eps)
    return _round(w1 * _round(y1 * inv[:, None], dt), dt), _round(w2 * _round(y2 * inv[:, None], dt), dt)


@triton.jit(do_not_specialize=["T"])
def rope_norm_kernel(qkv_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, q_ptr, k_ptr, v_ptr, T, eps,
                     K: tl.constexpr, G: tl.constexpr, H: tl.constexpr, ROWS: tl.constexpr,
                     PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    wait_for_predecessor(PDL, TRIGGER)
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]  # [ROWS, 1] tokens
    g = tl.program_id(1)
    HALF: tl.constexpr = H // 2
    lo = tl.arange(0, HALF)[None, :]
    m = t < T
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + t * H + lo, mask=m)  # the tables repeat their halves: cos[i] == cos[i + H/2]
    s = tl.load(sin_ptr + t * H + lo, mask=m)
    wq1, wq2 = tl.load(wq_ptr + lo).to(tl.float32), tl.load(wq_ptr + HALF + lo).to(tl.float32)
    row = qkv_ptr + t * (K * (G + 2) * H) + g * (G + 2) * H
    for j in tl.static_range(G):  # this group's query heads
        x1 = tl.load(row + j * H + lo, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(row + j * H + HALF + lo, mask=m, other=0.0).to(tl.float32)
        y1, y2 = _rope_norm_head(x1, x2, c, s, wq1, wq2, eps, H, dt)
        out = q_ptr + (t * K * G + g * G + j) * H
        tl.store(out + lo, y1.to(dt), mask=m)
        tl.store(out + HALF + lo, y2.to(dt), mask=m)
    wk1, wk2 = tl.load(wk_ptr + lo).to(tl.float32), tl.load(wk_ptr + HALF + lo).to(tl.float32)
    x1 = tl.load(row + G * H + lo, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + G * H + HALF + lo, mask=m, other=0.0).to(tl.float32)
    y1, y2 = _rope_norm_head(x1, x2, c, s, wk1, wk2, eps, H, dt)
    kout = k_ptr + (t * K + g) * H
    tl.store(kout + lo, y1.to(dt), mask=m)
    tl.store(kout + HALF + lo, y2.to(dt), mask=m)
    vout = v_ptr + (t * K + g) * H
    tl.store(vout + lo, tl.load(row + (G + 1) * H + lo, mask=m), mask=m)
    tl.store(vout + HALF + lo, tl.load(row + (G + 1) * H + HALF + lo, mask=m), mask=m)


@triton.jit(do_not_specialize=["T"])
def route_kernel(logits_ptr, w_ptr, ids_ptr, T, E, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, KPAD: tl.constexpr, ALWAYS: tl.constexpr = 0, PDL: tl.constexpr = False,
                 TRIGGER: tl.constexpr = False):
    """Rows of ``TOPK + ALWAYS`` columns: the renormalised top-k, then ids ``E + j`` with weight 1 (the fused
    shared expert, ``GlueSpec.always_on``); KPAD >= TOPK + ALWAYS."""
    wait_for_predecessor(PDL, TRIGGER)
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
    extra = (kcols[None, :] >= TOPK) & (kcols[None, :] < TOPK + ALWAYS)
    wk = tl.where(extra, 1.0, wk)
    ik = tl.where(extra, E + kcols[None, :] - TOPK, ik)
    km = rm[:, None] & (kcols[None, :] < TOPK + ALWAYS)
    off = rows[:, None].to(tl.int64) * (TOPK + ALWAYS) + kcols[None, :]
    tl.store(w_ptr + off, wk, mask=km)
    tl.store(ids_ptr + off, ik.to(tl.int64), mask=km)


@triton.jit(do_not_specialize=["S"])
def kv_kernel(kp_ptr, vp_ptr, k_ptr, v_ptr, write_ptr, gather_ptr, fresh_ptr, ko_ptr, vo_ptr, S, W,
              BLOCK: tl.constexpr, PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Programs [0, S): key-table row s from the new row ``fresh[s]`` or else pool slot ``gather[s]``;
    programs [S, S + T): new row t stored at pool slot ``write[t]``. Rows are ``W`` (kv heads x head dim) wide."""
    wait_for_predecessor(PDL, TRIGGER)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < W
    if pid < S:
        s = pid.to(tl.int64)
        t = tl.load(fresh_ptr + s)
        new = t >= 0
        slot = tl.load(gather_ptr + s)
        src_new = t * W + cols
        src_pool = slot * W + cols
        k = tl.where(new, tl.load(k_ptr + src_new, mask=m & new), tl.load(kp_ptr + src_pool, mask=m & (t < 0)))
        v = tl.where(new, tl.load(v_ptr + src_new, mask=m & new), tl.load(vp_ptr + src_pool, mask=m & (t < 0)))
        tl.store(ko_ptr + s * W + cols, k, mask=m)
        tl.store(vo_ptr + s * W + cols, v, mask=m)
    else:
        t = (pid - S).to(tl.int64)
        slot = tl.load(write_ptr + t)
        tl.store(kp_ptr + slot * W + cols, tl.load(k_ptr + t * W + cols, mask=m), mask=m)
        tl.store(vp_ptr + slot * W + cols, tl.load(v_ptr + t * W + cols, mask=m), mask=m)
