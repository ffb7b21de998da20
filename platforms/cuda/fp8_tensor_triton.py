"""Per-tensor e4m3 quantization in two Triton passes: ``attention.fp8``'s q, k and v.

Why: ``omni.quant.quantize_fp8(per_row=False)`` runs the absolute value, the max, an fp32 copy, the division,
the clamp and the cast as separate passes, mostly over fp32 copies: the image step's q, k and v took 0.70 ms that
way on an H100, as long as FA3's fp8 kernel itself (0.76 ms), which made ``attention.fp8`` slower than bf16
(BENCHMARKS.md, "Forty-seventh session").

Here one pass reduces ``|x|`` to its maximum (one fp32 atomic max per program into a zeroed cell), the scale is
made from it by ``omni.quant.scale_from_amax`` (two one-element torch ops: a correctly rounded division in the
kernel gave other scales than torch's CUDA division by a Python scalar on an H100), and one pass divides by the
scale and casts. ``x / scale`` is correctly rounded (``div_rn``, as torch's tensor division), clamped to +-448
and rounded to the nearest e4m3 (ties to even): the bits equal the reference's
(tests/gpu/test_gpu_fp8_tensor_quant.py). Capturable: the zeroed cell comes from the caller's allocator
(a graph's pool under capture) and nothing is read on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni import quant

BLOCK = 8192  # elements per program: 4096 programs and as many atomics for the image step's q (33.6 M elements)
WARPS = 8


@triton.jit
def absmax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


@triton.jit
def cast_kernel(x_ptr, scale_ptr, q_ptr, n, QMAX: tl.constexpr, BLOCK: tl.constexpr):
    scale = tl.load(scale_ptr)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    q = tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=m)


def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``x``, its fp32 scale ``[1, 1]``), as ``omni.quant.quantize_fp8(x, per_row=False)`` gives them."""
    x = x.contiguous()
    n = x.numel()
    if n == 0:
        empty_scale = x.new_full((1, 1), quant.SCALE_EPS, dtype=torch.float32)
        return torch.empty_like(x, dtype=torch.float8_e4m3fn), empty_scale
    amax = torch.zeros(1, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, BLOCK),)
    absmax_kernel[grid](x, amax, n, BLOCK=BLOCK, num_warps=WARPS)
    scale = quant.scale_from_amax(amax, quant.FP8_MAX)  # the reference's ops: the same bits (see there)
    q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    cast_kernel[grid](x, scale, q, n, QMAX=quant.FP8_MAX, BLOCK=BLOCK, num_warps=WARPS)
    return q, scale.view(1, 1)
