"""The dense e4m3 GEMM at a decode step's few rows (Triton): ``y = (xq @ wq^T) * xs[m] * ws[n]`` -> bf16.

Why: a decode step multiplies a few rows (one per answer) by each dense
weight of the layer (the attention's qkv and o_proj, the shared expert's two),
so the GEMM is a read of the weight, nothing more. cuBLAS runs these rows on
128x128 tiles: 32-48 tiles for N = 4096-6144, a third of the H200's SMs,
which read the weights at about a third of the memory's rate (1.64 ms of a
7.3 ms step for one answer at 32 layers, bench/profile_decode.py,
BENCHMARKS.md "Fifteenth session"). Here each program owns ``BLOCK_N``
output columns across the whole K: a few hundred programs, every SM reading.

May assume: ``triton`` imports; contiguous CUDA tensors; ``K`` a multiple of
``BLOCK_K`` (``SkinnyFp8.fits`` says which shapes qualify). Row-wise scales
only (``fp8_row``), no bias; the cuda platform runs it in recipes with fast
accumulation only (``Fp8Linear``). The tensor cores accumulate in fp32; the
product differs from cuBLAS's in its summation order: no further from the
fp64 product than cuBLAS's fast accumulation (tests/gpu/test_gpu_skinny_fp8.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import OFF, Pdl
from .pdl_triton import launch, wait_for_predecessor
from .triton_compile import compiling

_COMPILED: set = set()  # (device, tiles, max_rows, Pdl, out dtype) whose binaries compile_rows made


@dataclass(frozen=True)
class SkinnyTile:
    """Launch shape: output columns and K per program iteration, warps, pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int

    def label(self) -> str:
        return f"{self.block_n}x{self.block_k}w{self.warps}s{self.stages}"


# (most rows, launch shape) by rows: at each of 1, 8, 16, 32 and 64 rows the shape of 12 (BLOCK_N 16/32/64, BLOCK_K
# 256/512, 4 warps, 3/5 stages) whose slowest speedup over cuBLAS across the released model's three dense shapes
# was the highest (bench/bench_skinny_fp8.py on the H200, BENCHMARKS.md "Sixteenth session"): 1.39-1.41x at 1-16
# rows, 1.36x at 32, 1.70x at 64. Past the last row count cuBLAS keeps the GEMM (not measured past it).
TILES = ((16, SkinnyTile(block_n=32, block_k=512, warps=4, stages=3)),
         (32, SkinnyTile(block_n=64, block_k=512, warps=4, stages=3)),
         (64, SkinnyTile(block_n=64, block_k=256, warps=4, stages=3)))


@triton.jit(do_not_specialize=["M"])
def _skinny_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Columns ``[pid * BLOCK_N, +BLOCK_N)`` of all ``M`` rows (padded to ``BLOCK_M``): the whole K in one program."""
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, nm = rm < M, rn < N
    wait_for_predecessor(PDL, TRIGGER)
    x_ptrs = x_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_N]: W^T's tile, read along K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=mm[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=nm[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    xs = tl.load(xs_ptr + rm, mask=mm, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=nm, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=mm[:, None] & nm[None, :])


class SkinnyFp8:
    """The kernel for up to ``max_rows`` rows (``fits``), launched with the first shape of ``tiles`` (most rows,
    tile) that takes the call's rows."""

    def __init__(self, max_rows: int, tiles=TILES, pdl: Pdl = OFF):
        self.tiles, self.max_rows, self.pdl = tiles, min(max_rows, tiles[-1][0]), pdl
        shapes = ",".join(t.label() for _, t in tiles)
        self.name = f"triton-skinny-fp8[{shapes},<={self.max_rows}]"

    def tile_for(self, rows: int) -> SkinnyTile:
        return next(t for most, t in self.tiles if rows <= most)

    def launches(self) -> dict:
        """One row count per binary the kernel has up to ``max_rows`` rows: its tile, ``BLOCK_M`` and PDL keywords
        change with the rows (``M`` itself is not specialized)."""
        keys = {}
        for m in range(1, self.max_rows + 1):
            t = self.tile_for(m)
            keys.setdefault((t, max(16, triton.next_power_of_2(m)), tuple(sorted(self.pdl.kw(m).items()))), m)
        return keys

    def compile_rows(self, out_dtype: torch.dtype) -> int:
        """One call per binary (``launches``) on small zero operands of the real dtypes, on the current device, so
        Triton compiles them at build time and not in the first prompt or decode step of each row class (BLOCK_K
        divides the K used, as it divides the model's; N and K are multiples of 16 like the model's, so the same
        binaries serve it). Once per device, kernel shape and ``out_dtype`` in a process; returns the calls."""
        key = (torch.cuda.current_device(), self.tiles, self.max_rows, self.pdl, out_dtype)
        if key in _COMPILED:
            return 0
        rows = list(self.launches().values())
        K, N = max(t.block_k for _, t in self.tiles), max(t.block_n for _, t in self.tiles)
        w, ws = torch.zeros(N, K, device="cuda").to(torch.float8_e4m3fn), torch.ones(N, device="cuda")
        with compiling():  # compiled in parallel, not run
            for m in rows:
                self(torch.zeros(m, K, device="cuda").to(torch.float8_e4m3fn), torch.ones(m, 1, device="cuda"), w, ws,
                     out_dtype)
        _COMPILED.add(key)
        return len(rows)

    def fits(self, xq_MK: torch.Tensor) -> bool:
        """Whether this kernel takes these rows: on the device, at most ``max_rows`` of them, K a multiple of the
        tile's (shapes only, read on the host: capture-safe)."""
        rows, K = xq_MK.shape
        return xq_MK.is_cuda and 0 < rows <= self.max_rows and K % self.tile_for(rows).block_k == 0

    def __call__(self, xq_MK: torch.Tensor, xs_M1: torch.Tensor, wq_NK: torch.Tensor, ws_N: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """e4m3 rows ``[M, K]`` with fp32 row scales times the e4m3 weight ``[N, K]`` (row-major, the platform's
        ``[O, I]``) with fp32 ``[N]`` scales -> ``[M, N]`` in ``out_dtype``."""
        M, K = xq_MK.shape
        N = wq_NK.shape[0]
        y = torch.empty(M, N, dtype=out_dtype, device=xq_MK.device)
        t = self.tile_for(M)
        launch(  # siblings=False: compile_rows compiles each row class's binary (launches)
            _skinny_fp8_kernel, (triton.cdiv(N, t.block_n),), self.pdl, M,
            xq_MK.contiguous(), xs_M1.reshape(-1).float().contiguous(), wq_NK, ws_N.reshape(-1).float().contiguous(),
            y, M, N, K,
            BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            num_warps=t.warps, num_stages=t.stages, siblings=False)
        return y
