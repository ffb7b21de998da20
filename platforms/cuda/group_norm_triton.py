"""One-pass "GroupNorm [, FiLM], SiLU" for the CUDA glue (``group_norm``): ``omni.group_norm.group_norm_act``.

May assume: ``triton`` imports (``glue.py`` imports this module only then) and ``x`` is a CUDA tensor
``[B, C, *]``, either contiguous (a group is one run of ``C/G * S`` values) or channels-last (memory
``[B, S, C]``: a group is ``C/G`` values at every position), with ``C`` and ``C/G`` powers of two in the
channels-last case. Anything else is made contiguous first.

Three launches instead of torch's five to seven full passes (moments, ``addcmul``, casts, FiLM, SiLU):

    stats_rows / stats_cl   per (sample, chunk of positions): each group's mean and sum of squared
                            deviations, tile by tile, merged by Chan's pairwise formula (no E[x^2] - mean^2
                            cancellation, so a mean far from zero keeps its variance)
    finalize                per (sample, group): the chunks merged the same way, ``rstd = 1/sqrt(var + eps)``
    apply_rows / apply_cl   ``y = x * a + b`` with ``a = w * rstd``, ``b = bias - mean * a`` (torch's form),
                            rounded to the norm dtype, then FiLM and SiLU each rounded there, then the output
                            dtype: the reference's roundings (``group_norm_act``)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni.group_norm import channels_last, group_norm_act as reference_act

from .glue import _pow2
from .triton_compile import run_or_compile

TILE = 8192  # values per program per loop trip (stats) or per program (apply)
PROGRAMS = 1024  # stats programs to aim for: several per SM, few enough chunks for one finalize block


@triton.jit
def _merge(n, mean, m2, n_t, mean_t, m2_t):
    """Chan et al.'s pairwise merge of (count, mean, M2) summaries."""
    tot = n + n_t
    frac = n_t / tl.maximum(tot, 1.0)
    delta = mean_t - mean
    return tot, mean + delta * frac, m2 + m2_t + delta * delta * n * frac


@triton.jit(do_not_specialize=["K"])  # the chunk count follows the image size; stored one value at a time
def stats_rows_kernel(x_ptr, mean_ptr, m2_ptr, cnt_ptr, L, CHUNK, K, BLOCK: tl.constexpr):
    """Contiguous layout: row r = (sample, group) of L values; program (k, r) summarises chunk k of it."""
    k, r = tl.program_id(0), tl.program_id(1)
    start = k * CHUNK
    end = tl.minimum(start + CHUNK, L)
    base = x_ptr + r.to(tl.int64) * L
    n = tl.zeros((), tl.float32)
    mean = tl.zeros((), tl.float32)
    m2 = tl.zeros((), tl.float32)
    for i in range(0, CHUNK, BLOCK):  # the last chunk's trailing trips see no values (n_t = 0 merges nothing)
        offs = start + i + tl.arange(0, BLOCK)
        m = offs < end
        x = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
        n_t = tl.sum(m.to(tl.float32), axis=0)
        mean_t = tl.sum(x, axis=0) / tl.maximum(n_t, 1.0)
        d = tl.where(m, x - mean_t, 0.0)
        n, mean, m2 = _merge(n, mean, m2, n_t, mean_t, tl.sum(d * d, axis=0))
    out = r * K + k
    tl.store(mean_ptr + out, mean)
    tl.store(m2_ptr + out, m2)
    tl.store(cnt_ptr + out, n)


@triton.jit(do_not_specialize=["S", "CHUNK", "K"])  # the image size: one binary for all (winograd_triton)
def stats_cl_kernel(x_ptr, mean_ptr, m2_ptr, cnt_ptr, S, CHUNK, K, C: tl.constexpr, G: tl.constexpr,
                    ROWS: tl.constexpr):
    """Channels-last layout: sample b is S positions of C values; program (k, b) summarises positions
    [k * CHUNK, (k + 1) * CHUNK) for all G groups at once, ROWS positions per trip."""
    k, b = tl.program_id(0), tl.program_id(1)
    start = k * CHUNK
    end = tl.minimum(start + CHUNK, S)
    base = x_ptr + b.to(tl.int64) * S * C
    cols = tl.arange(0, C)
    n = tl.zeros((G,), tl.float32)
    mean = tl.zeros((G,), tl.float32)
    m2 = tl.zeros((G,), tl.float32)
    for i in range(0, CHUNK, ROWS):
        rows = start + i + tl.arange(0, ROWS)
        rm = rows < end
        x = tl.load(base + rows[:, None].to(tl.int64) * C + cols[None, :], mask=rm[:, None], other=0.0)
        x = tl.reshape(x.to(tl.float32), (ROWS, G, C // G))
        n_t = tl.sum(rm.to(tl.float32), axis=0) * (C // G)
        mean_t = tl.sum(tl.sum(x, axis=2), axis=0) / tl.maximum(n_t, 1.0)
        d = tl.where(rm[:, None, None], x - mean_t[None, :, None], 0.0)
        n, mean, m2 = _merge(n, mean, m2, n_t, mean_t, tl.sum(tl.sum(d * d, axis=2), axis=0))
    out = b * G * K + tl.arange(0, G) * K + k
    tl.store(mean_ptr + out, mean)
    tl.store(m2_ptr + out, m2)
    tl.store(cnt_ptr + out, n)


@triton.jit(do_not_specialize=["K"])
def finalize_kernel(mean_ptr, m2_ptr, cnt_ptr, mu_ptr, rstd_ptr, K, eps, BLOCK_K: tl.constexpr):
    """Per (sample, group): merge its K chunk summaries; mean and 1/sqrt(biased var + eps)."""
    r = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    m = ks < K
    n_k = tl.load(cnt_ptr + r * K + ks, mask=m, other=0.0)
    mean_k = tl.load(mean_ptr + r * K + ks, mask=m, other=0.0)
    n = tl.sum(n_k, axis=0)
    mean = tl.sum(n_k * mean_k, axis=0) / n
    d = mean_k - mean
    m2 = tl.sum(tl.load(m2_ptr + r * K + ks, mask=m, other=0.0), axis=0) + tl.sum(n_k * d * d, axis=0)
    tl.store(mu_ptr + r, mean)
    tl.store(rstd_ptr + r, 1.0 / tl.sqrt(m2 / n + eps))


@triton.jit
def _rnd(y, NORM_DT: tl.constexpr):
    """fp32 ``y`` rounded to NORM_DT (nearest, ties to even) and kept in fp32. bf16 is spelled in integer ops
    (add half an ulp, with the tie going to the even side, then drop 16 bits) so that no compiler pass can
    fold the narrowing and widening into nothing; infinities stay, finite values past bf16's range round
    to infinity as a conversion does."""
    if NORM_DT == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    elif NORM_DT == tl.float16:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _act(x, a, b, scale, shift, NORM_DT: tl.constexpr, FILM: tl.constexpr, SILU: tl.constexpr):
    """The reference's chain on fp32 values, rounding to NORM_DT after each torch op it mirrors."""
    y = _rnd(x * a + b, NORM_DT)
    if FILM:
        y = _rnd(y * _rnd(1.0 + scale, NORM_DT), NORM_DT)
        y = _rnd(y + shift, NORM_DT)
    if SILU:
        y = _rnd(y / (1.0 + tl.exp(-y)), NORM_DT)
    return y


@triton.jit
def apply_rows_kernel(x_ptr, y_ptr, mu_ptr, rstd_ptr, w_ptr, bias_ptr, scale_ptr, shift_ptr, S, C, G,
                      BLOCK: tl.constexpr, NORM_DT: tl.constexpr, FILM: tl.constexpr, SILU: tl.constexpr):
    """Contiguous layout: program (j, row) with row = b * C + c covers positions [j * BLOCK, (j + 1) * BLOCK)."""
    j, row = tl.program_id(0), tl.program_id(1)
    b, c = row // C, row % C
    g = b * G + c // (C // G)
    a = tl.load(rstd_ptr + g) * tl.load(w_ptr + c).to(tl.float32)
    beta = tl.load(bias_ptr + c).to(tl.float32) - tl.load(mu_ptr + g) * a
    scale, shift = 0.0, 0.0
    if FILM:
        scale = tl.load(scale_ptr + row).to(tl.float32)
        shift = tl.load(shift_ptr + row).to(tl.float32)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    m = offs < S
    base = row.to(tl.int64) * S
    x = tl.load(x_ptr + base + offs, mask=m, other=0.0).to(tl.float32)
    y = _act(x, a, beta, scale, shift, NORM_DT, FILM, SILU)
    tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["S"])
def apply_cl_kernel(x_ptr, y_ptr, mu_ptr, rstd_ptr, w_ptr, bias_ptr, scale_ptr, shift_ptr, S,
                    C: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, NORM_DT: tl.constexpr,
                    FILM: tl.constexpr, SILU: tl.constexpr):
    """Channels-last layout: program (j, b) covers positions [j * ROWS, (j + 1) * ROWS) of sample b."""
    j, b = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, C)
    g = b * G + cols // (C // G)
    a = tl.load(rstd_ptr + g) * tl.load(w_ptr + cols).to(tl.float32)
    beta = tl.load(bias_ptr + cols).to(tl.float32) - tl.load(mu_ptr + g) * a
    scale, shift = tl.zeros((C,), tl.float32), tl.zeros((C,), tl.float32)
    if FILM:
        scale = tl.load(scale_ptr + b * C + cols).to(tl.float32)
        shift = tl.load(shift_ptr + b * C + cols).to(tl.float32)
    rows = j * ROWS + tl.arange(0, ROWS)
    m = (rows < S)[:, None]
    off = b.to(tl.int64) * S * C + rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
    y = _act(x, a[None, :], beta[None, :], scale[None, :], shift[None, :], NORM_DT, FILM, SILU)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=m)


_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _chunks(n: int, step: int, parts: int) -> tuple[int, int]:
    """(chunk length, chunk count): about ``parts`` chunks of a multiple of ``step``, covering ``n``."""
    parts = max(1, min(parts, triton.cdiv(n, step)))
    chunk = triton.cdiv(triton.cdiv(n, parts), step) * step
    return chunk, triton.cdiv(n, chunk)


def group_norm_act(x, num_groups, weight, bias, eps, *, norm_dtype, out_dtype, silu=False, scale_BC=None,
                   shift_BC=None):
    """``omni.group_norm.group_norm_act`` in three launches; the result keeps ``x``'s layout."""
    chain = dict(norm_dtype=norm_dtype, out_dtype=out_dtype, silu=silu, scale_BC=scale_BC, shift_BC=shift_BC)
    B, C, G = x.shape[0], x.shape[1], num_groups
    cl = channels_last(x) and _pow2(C) and _pow2(C // G) and C <= 4 * TILE
    if not cl and B * C > 65535:  # the contiguous apply puts (sample, channel) on the grid's second axis
        return reference_act(x, num_groups, weight, bias, eps, **chain)
    if not cl and channels_last(x):  # channels the kernels cannot tile: computed contiguous, handed back as given
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        return group_norm_act(x.contiguous(), num_groups, weight, bias, eps, **chain).contiguous(memory_format=fmt)
    x = x if cl else x.contiguous()
    y = torch.empty_like(x, dtype=out_dtype)
    if x.numel():
        mu, rstd = _moments(x, G, eps, cl)
        _apply(x, y, mu, rstd, weight, bias, G, cl, norm_dtype, silu, scale_BC, shift_BC)
    return y


def _moments(x, G: int, eps: float, cl: bool):
    """Each (sample, group)'s mean and 1/sqrt(var + eps), fp32 ``[B * G]``: chunk summaries, then their merge."""
    B, C = x.shape[:2]
    S = x.numel() // (B * C)
    if cl:
        rows = max(1, TILE // C)
        chunk, K = _chunks(S, rows, triton.cdiv(PROGRAMS, B))
    else:
        chunk, K = _chunks(C // G * S, TILE, triton.cdiv(PROGRAMS, B * G))
    part = torch.empty(3, B * G * K, dtype=torch.float32, device=x.device)
    if cl:
        run_or_compile(stats_cl_kernel, (K, B), x, *part, S, chunk, K, C=C, G=G, ROWS=rows, num_warps=8)
    else:
        run_or_compile(stats_rows_kernel, (K, B * G), x, *part, C // G * S, chunk, K, BLOCK=TILE, num_warps=8)
    mu, rstd = torch.empty(2, B * G, dtype=torch.float32, device=x.device)
    run_or_compile(finalize_kernel, (B * G,), *part, mu, rstd, K, eps, BLOCK_K=triton.next_power_of_2(K))
    return mu, rstd


def _apply(x, y, mu, rstd, weight, bias, G: int, cl: bool, norm_dtype, silu: bool, scale_BC, shift_BC) -> None:
    """``y`` = the normalised, modulated, activated ``x`` (one pass)."""
    B, C = x.shape[:2]
    S = x.numel() // (B * C)
    film = scale_BC is not None
    scale = scale_BC.to(norm_dtype).contiguous() if film else x  # the reference rounds them to norm_dtype first
    shift = shift_BC.to(norm_dtype).contiguous() if film else x
    flags = dict(NORM_DT=_DTYPES[norm_dtype], FILM=film, SILU=silu, num_warps=8)
    if cl:
        rows = max(1, TILE // C)
        run_or_compile(apply_cl_kernel, (triton.cdiv(S, rows), B), x, y, mu, rstd, weight, bias, scale, shift, S,
                       C=C, G=G, ROWS=rows, **flags)
    else:
        block = min(2048, triton.next_power_of_2(S))
        run_or_compile(apply_rows_kernel, (triton.cdiv(S, block), B * C), x, y, mu, rstd, weight, bias, scale,
                       shift, S, C, G, BLOCK=block, **flags)
