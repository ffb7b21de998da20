"""The router's fp32 product at a decode step's few rows (Triton): bf16 rows times a weight split into bf16 parts.

Why: ``gemm.SplitFp32Linear`` computes the MoE router (``[T, 4096] -> [T, 64]``
in fp32) as one bf16 GEMM over the weight's three bf16 parts (hi, mid, lo)
and a sum over the parts. For a decode step's few rows that is three kernels
(cuBLAS's split-K GEMM, its reduction, the sum) of 9.3 us a layer for 1.5 MB
of weight (bench/profile_decode.py, BENCHMARKS.md "Seventeenth session"). Here
one program per output column reads its three weight rows and all the call's
rows and sums the products in fp32 registers: one launch.

Numbers: a bf16 row element times a bf16 part element is exact in fp32 (8 + 8
significant bits), so every product is exact; the sums run in fp32 with
ordinary rounding (no tensor-core truncation), one partial sum per lane of
``BLOCK_K`` and then a tree. The same function as the split GEMM, summed in
another order (tests/gpu/test_gpu_router_rows.py holds both to the fp64
product).

May assume: ``triton`` imports; contiguous CUDA tensors, bf16 rows, the
prepared ``[3O, I]`` bf16 parts; ``I`` a multiple of ``BLOCK_K``
(``SplitFp32Few.fits``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import OFF, Pdl
from .pdl_triton import wait_for_predecessor

PARTS = 3  # hi, mid, lo: ``SplitFp32Linear.prepare_weight``
MAX_ROWS = 64  # [rows, BLOCK_K] fp32 partial sums per program stay at 8192 elements (64 registers a thread)


@triton.jit(do_not_specialize=["M"])
def _split_fp32_kernel(x_ptr, w_ptr, y_ptr, M, O, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       PARTS: tl.constexpr, PDL: tl.constexpr = False):
    """Output column ``pid`` of all ``M`` rows: ``sum_k x[m, k] * sum_p w[p * O + pid, k]`` in fp32."""
    o = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mm = rm < M
    wait_for_predecessor(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mm[:, None], other=0.0).to(tl.float32)
        for p in tl.static_range(PARTS):  # exact products, the parts in order
            w = tl.load(w_ptr + (p * O + o).to(tl.int64) * K + rk).to(tl.float32)
            acc += x * w[None, :]
    tl.store(y_ptr + rm * O + o, tl.sum(acc, axis=1), mask=mm)


class SplitFp32Few:
    """The kernel for up to ``max_rows`` bf16 rows (``fits``)."""

    def __init__(self, max_rows: int, pdl: Pdl = OFF):
        self.max_rows, self.pdl = min(max_rows, MAX_ROWS), pdl
        self.name = f"triton-router-rows[<={self.max_rows}]"

    @staticmethod
    def block_k(rows: int) -> int:
        return 8192 // max(16, triton.next_power_of_2(rows))

    def fits(self, x_TI: torch.Tensor, parts: torch.Tensor) -> bool:
        """Whether this kernel takes the call: bf16 rows on the device, at most ``max_rows`` of them, the bf16
        parts, I a multiple of the tile (shapes and dtypes only: capture-safe)."""
        rows, K = x_TI.shape
        return (x_TI.is_cuda and x_TI.dtype == torch.bfloat16 and parts.dtype == torch.bfloat16
                and 0 < rows <= self.max_rows and K % self.block_k(rows) == 0)

    def __call__(self, x_TI: torch.Tensor, parts_PO_I: torch.Tensor) -> torch.Tensor:
        """bf16 rows ``[T, I]`` times the ``[3O, I]`` parts -> fp32 ``[T, O]``."""
        T, K = x_TI.shape
        O = parts_PO_I.shape[0] // PARTS
        y = torch.empty(T, O, dtype=torch.float32, device=x_TI.device)
        block_m = max(16, triton.next_power_of_2(T))
        _split_fp32_kernel[(O,)](x_TI.contiguous(), parts_PO_I, y, T, O, K, BLOCK_M=block_m,
                                 BLOCK_K=self.block_k(T), PARTS=PARTS, num_warps=4, **self.pdl.kw(T))
        return y
