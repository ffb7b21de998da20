"""Triton kernels of the CUDA MoE: the memory-bound steps between the two grouped GEMMs, fused.

May assume: ``triton`` imports (``moe.py`` imports this module only then) and
every tensor is a contiguous CUDA tensor. One program per row; no host reads.

    quant_gather   x[token_R[r]] -> e4m3 row r and its per-row fp32 scale (gather + dynamic quantization);
                   ``quant_rows`` is the same without the gather (the dense fp8_row linears' activations)
    scatter_rows   out[inverse_R[t*k + j]] = q[t] (and its scale): rows a glue kernel quantized already, each
                   read once and written k times (1 byte per element moved)
    swiglu         h[r] = [x1 | x2] -> x1 * silu(x2), as bf16 or as e4m3 + per-row scale
    combine        out[t] = sum(addends)[t] + sum_j w[t, j] * y[inverse[t*k + j]] (fp32 accumulate, one rounding)
    route_rows     the stable counting sort by expert, and ``route_padded`` its padded layout: ``route_triton``

The quantization is ``omni.quant``'s (absmax / 448, clamp, round to nearest
e4m3) computed in fp32 from the bf16 inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import OFF, Pdl
from .pdl_triton import HAS_GDC, launch, wait_for_predecessor
from .route_triton import TritonSort

FP8_MAX = 448.0


@triton.jit
def _kept_rows(rows, T, expert_ptr, SKIP: tl.constexpr):
    """The rows a program computes: those below ``T``, less (``SKIP``) the padded layout's padding (expert -1),
    whose products nobody reads (``padded_route``)."""
    keep = rows < T
    if SKIP:
        keep = keep & (tl.load(expert_ptr + rows, mask=keep, other=-1) >= 0)
    return keep


@triton.jit(do_not_specialize=["T"])
def _quant_kernel(x_ptr, token_ptr, expert_ptr, q_ptr, s_ptr, T, D, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                  QMAX: tl.constexpr, GATHER: tl.constexpr, SKIP: tl.constexpr = False,
                  PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Rows ``[ROWS]`` of the output: e4m3 of source row ``token[r]`` (``GATHER``) or ``r``, and its scale;
    ``SKIP``: rows whose ``expert`` is -1 (the padded layout's padding) are left unwritten."""
    wait_for_predecessor(PDL, TRIGGER)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    rm = _kept_rows(rows, T, expert_ptr, SKIP)
    m = rm[:, None] & (cols < D)[None, :]
    src = tl.load(token_ptr + rows, mask=rm, other=0).to(tl.int64) if GATHER else rows
    x = tl.load(x_ptr + src[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=1) / QMAX, 1e-12)
    q = tl.minimum(tl.maximum(x / s[:, None], -QMAX), QMAX)
    tl.store(q_ptr + rows[:, None] * D + cols[None, :], q.to(tl.float8e4nv), mask=m)
    tl.store(s_ptr + rows, s, mask=rm)


@triton.jit(do_not_specialize=["T"])
def _scatter_rows_kernel(q_ptr, s_ptr, inv_ptr, out_ptr, out_s_ptr, T, D, K: tl.constexpr, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Tokens ``[ROWS]``: each e4m3 row read once and written to its ``K`` sorted rows (``inverse``), and its
    scale with it."""
    wait_for_predecessor(PDL, TRIGGER)
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    tm = t < T
    for start in tl.range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = tm[:, None] & (cols < D)[None, :]
        row = tl.load(q_ptr + t[:, None] * D + cols[None, :], mask=m)
        for j in tl.static_range(K):
            r = tl.load(inv_ptr + t * K + j, mask=tm, other=0).to(tl.int64)
            tl.store(out_ptr + r[:, None] * D + cols[None, :], row, mask=m)
    s = tl.load(s_ptr + t, mask=tm)
    for j in tl.static_range(K):
        tl.store(out_s_ptr + tl.load(inv_ptr + t * K + j, mask=tm, other=0).to(tl.int64), s, mask=tm)


@triton.jit(do_not_specialize=["R"])
def _swiglu_kernel(h_ptr, expert_ptr, out_ptr, s_ptr, R, I, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                   QUANT: tl.constexpr, QMAX: tl.constexpr, SKIP: tl.constexpr = False,
                   PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """As ``_quant_kernel`` for ``SKIP``."""
    wait_for_predecessor(PDL, TRIGGER)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    rm = _kept_rows(rows, R, expert_ptr, SKIP)
    m = rm[:, None] & (cols < I)[None, :]
    src = h_ptr + rows[:, None] * 2 * I + cols[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + I, mask=m, other=0.0).to(tl.float32)
    a = x1 * (x2 * tl.sigmoid(x2))
    dst = rows[:, None] * I + cols[None, :]
    if QUANT:
        s = tl.maximum(tl.max(tl.abs(a), axis=1) / QMAX, 1e-12)
        q = tl.minimum(tl.maximum(a / s[:, None], -QMAX), QMAX)
        tl.store(out_ptr + dst, q.to(tl.float8e4nv), mask=m)
        tl.store(s_ptr + rows, s, mask=rm)
    else:
        tl.store(out_ptr + dst, a.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(y_ptr, inv_ptr, w_ptr, a0_ptr, a1_ptr, out_ptr, T, D, K: tl.constexpr, ADDENDS: tl.constexpr,
                    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                    PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    wait_for_predecessor(PDL, TRIGGER)
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tm = t < T
    m = tm[:, None] & (d < D)[None, :]
    td = t[:, None] * D + d[None, :]
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    if ADDENDS >= 1:  # the addends first, in order (omni.moe.add_terms)
        acc += tl.load(a0_ptr + td, mask=m, other=0.0).to(tl.float32)
    if ADDENDS >= 2:
        acc += tl.load(a1_ptr + td, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inv_ptr + t * K + j, mask=tm, other=0).to(tl.int64)
        w = tl.load(w_ptr + t * K + j, mask=tm, other=0.0).to(tl.float32)
        acc += tl.load(y_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0).to(tl.float32) * w[:, None]
    tl.store(out_ptr + td, acc.to(out_ptr.dtype.element_ty), mask=m)


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


class TritonKernels(TritonSort):
    name = "triton"

    def __init__(self, pdl: Pdl = OFF):
        from .glue_triton import Tile

        self.pdl = pdl if HAS_GDC else OFF  # which calls launch with PDL (``kernels.pdl_rows``)

        # the routed rows' SwiGLU (65,552 rows x 3072): 1 x 8 measured within 2-4% of the best of 9 shapes
        self.swiglu_tile = Tile(1, 8)
        # quant_rows' launch shape per row width; bench/bench_row_kernels.py on an H200 (BENCHMARKS.md, "Tenth
        # session"): the SwiGLU epilogue's h (65,552 x 3072) 212.8 -> 172.5 us at 2 x 4, o_proj's input
        # (8194 x 4096) 68.0 -> 56.7 us at 4 x 16 (the bytes floors: 143.5 and 23.9 us); other widths 1 x 8
        self.quant_tiles = {3072: Tile(2, 4), 4096: Tile(4, 16)}
        self.quant_tile = Tile(1, 8)
        # the e4m3 rows' scatter (8194 tokens of 4096 to 65,552 sorted rows) and the combine (8194 tokens x 8 rows
        # of 4096 + 2 addends): tokens per program and warps
        self.scatter_tile = Tile(1, 4)
        self.combine_tile = Tile(1, 4)

    def skinny_fp8(self, max_rows: int):
        """The dense e4m3 GEMM for at most ``max_rows`` rows (``skinny_triton``), for ``Fp8Linear``."""
        from .skinny_triton import SkinnyFp8

        return SkinnyFp8(max_rows, pdl=self.pdl)

    def grouped_skinny_fp8(self, max_rows: int, swiglu: bool):
        """The grouped e4m3 expert GEMM for groups of at most ``max_rows`` rows (``grouped_skinny_triton``), in
        front of the MoE's CUTLASS builds."""
        from .grouped_skinny_triton import GroupedSkinnyFp8

        return GroupedSkinnyFp8(max_rows, swiglu, pdl=self.pdl)

    def quant_gather(self, x_TD: torch.Tensor, token_R: torch.Tensor, expert_R: torch.Tensor | None = None):
        """``expert_R``: the padded layout's expert of each row (``padded_route``); its padding rows (-1) are
        left unwritten, as no GEMM output of theirs is read."""
        x = x_TD.contiguous()
        R, D = token_R.numel(), x.shape[1]
        q = torch.empty(R, D, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(R, dtype=torch.float32, device=x.device)
        if R:
            block = triton.next_power_of_2(D)
            skip = expert_R is not None
            launch(_quant_kernel, (R,), self.pdl, R, x, token_R, expert_R if skip else token_R, q, s, R, D,
                   BLOCK=block, ROWS=1, QMAX=FP8_MAX, GATHER=True, SKIP=skip, num_warps=_warps(block))
        return q, s[:, None]

    def scatter_rows(self, q_TD: torch.Tensor, s_T1: torch.Tensor, inverse_R: torch.Tensor, rows: int | None = None):
        """Rows quantized already, in the sort's order: ``(out [R, D] e4m3, out_s [R, 1] fp32)`` with
        ``out[inverse_R[t*k + j]] = q[t]``. Each token's row is read once and written ``k`` times: a gather by
        sorted row read each token's row ``k`` times, at random, after the writes had pushed it out of L2.
        ``rows``: the output's rows where it has more than ``R`` (the padded layout: its padding left unwritten)."""
        q, s = q_TD.contiguous(), s_T1.reshape(-1).float().contiguous()
        (T, D), R = q.shape, inverse_R.numel()
        if T and R % T:
            raise ValueError(f"cuda-moe scatter_rows: {R} sorted rows are not k per token of {T}")
        out = torch.empty(rows or R, D, dtype=q.dtype, device=q.device)
        out_s = torch.empty(rows or R, dtype=torch.float32, device=q.device)
        if R:
            tile = self.scatter_tile
            launch(_scatter_rows_kernel, (triton.cdiv(T, tile.rows),), self.pdl, R, q, s, inverse_R, out, out_s,
                   T, D, K=R // T, BLOCK=min(4096, triton.next_power_of_2(D)), ROWS=tile.rows, num_warps=tile.warps)
        return out, out_s[:, None]

    def quant_rows(self, x_TD: torch.Tensor):
        """Per-row e4m3 quantization of a 2-D tensor in one pass: ``(q [T, D], scale [T, 1] fp32)``."""
        x = x_TD.contiguous()
        T, D = x.shape
        q = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(T, dtype=torch.float32, device=x.device)
        if T:
            tile = self.quant_tiles.get(D, self.quant_tile)
            launch(_quant_kernel, (triton.cdiv(T, tile.rows),), self.pdl, T, x, x, x, q, s, T, D,
                   BLOCK=triton.next_power_of_2(D), ROWS=tile.rows, QMAX=FP8_MAX, GATHER=False, num_warps=tile.warps)
        return q, s[:, None]

    def swiglu(self, h_R2I: torch.Tensor, quantize: bool, tile=None, expert_R: torch.Tensor | None = None):
        """``tile``: the launch shape (rows per program, warps); the routed rows' ``swiglu_tile`` by default.
        ``expert_R``: as ``quant_gather``'s (the padding rows left unwritten)."""
        h = h_R2I.contiguous()
        R, I = h.shape[0], h.shape[1] // 2
        out = torch.empty(R, I, dtype=torch.float8_e4m3fn if quantize else h.dtype, device=h.device)
        s = torch.empty(R, dtype=torch.float32, device=h.device)
        if R:
            tile = tile or self.swiglu_tile
            skip = expert_R is not None
            launch(_swiglu_kernel, (triton.cdiv(R, tile.rows),), self.pdl, R, h, expert_R if skip else h, out, s, R,
                   I, BLOCK=triton.next_power_of_2(I), ROWS=tile.rows, QUANT=quantize, QMAX=FP8_MAX, SKIP=skip,
                   num_warps=tile.warps)
        return (out, s[:, None]) if quantize else (out, None)

    def combine(self, y_RD: torch.Tensor, inverse_R: torch.Tensor, w_Tk: torch.Tensor, dtype: torch.dtype,
                addends: tuple = ()):
        """``sum(addends) + sum_j w[t, j] * y[inverse[t*k + j]]`` in fp32, rounded once; at most two addends."""
        if len(addends) > 2:
            raise ValueError(f"cuda-moe combine: at most two addends, got {len(addends)}")
        T, k = w_Tk.shape
        D = y_RD.shape[1]
        out = torch.empty(T, D, dtype=dtype, device=y_RD.device)
        a = [t.reshape(T, D).contiguous() for t in addends] + [out] * (2 - len(addends))  # unread placeholders
        if T:
            tile, block = self.combine_tile, 1024
            launch(_combine_kernel, (triton.cdiv(T, tile.rows), triton.cdiv(D, block)), self.pdl, T,
                   y_RD.contiguous(), inverse_R, w_Tk.float().contiguous(), a[0], a[1], out, T, D, K=k,
                   ADDENDS=len(addends), BLOCK_D=block, ROWS=tile.rows, num_warps=tile.warps)
        return out
