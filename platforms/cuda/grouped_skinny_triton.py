"""The grouped e4m3 expert GEMM at a decode step's few rows per expert (Triton).

    y[rows of expert e] = (xq[rows] @ wq[e]^T) * xs[row] * ws[e, col]   -> bf16 [R, N]
    or, with ``swiglu``: x1 * silu(x2) of each adjacent column pair      -> bf16 [R, N / 2]

the same function, operands and layouts as our CUTLASS build (``cutlass_grouped``:
rows sorted by expert, ``offs_E`` the int32 cumulative group ends on the device,
experts ``[E, N, K]`` row-major, SwiGLU weights with their rows in (x1, x2) pairs).

Why: a decode step sends each answer's token to 8 of 64 experts, so its expert
GEMMs read a few experts' whole weights for a handful of rows each: a read of
the weights, nothing more. The CUTLASS builds run these rows on 64- or 128-row
tiles of 128 columns (48 tiles an expert at N = 6144): the 32-layer step of one
answer read its expert weights at about 3.3 TB/s of the memory's 4.8
(BENCHMARKS.md, "Sixteenth session"). Here a program owns ``BLOCK_N`` columns of
one expert's ``BLOCK_M``-row tile across the whole K, as the dense skinny kernel
does (``skinny_triton``): several hundred programs an expert, every SM reading.

How a program finds its rows without a host read (capturable): the grid's second
axis counts (expert, row block) tiles up to a bound known from the shapes
(``tile_bound``); each program recomputes the experts' tile counts from
``offs_E`` (64 integers) and takes the expert whose cumulative count passes its
index; programs past the last tile return at once.

Rows per tile: a group split over two row blocks has its weight read twice.
Routing may send every token to the same experts (identical prompts decoded
greedily do), so the caller passes ``group_rows``, a bound on any group's rows
(the MoE's token count: a token's k experts are distinct); ``fits`` takes a
call only while that bound fits the largest measured tile, which is then the
smallest tile that holds such a group whole.

May assume: ``triton`` imports; contiguous CUDA operands; ``K`` a multiple of
``BLOCK_K`` and ``N`` of ``BLOCK_N`` (``fits``). The sums run in another order than
CUTLASS's (not its bits): tests/gpu/test_gpu_grouped_skinny.py holds them to the
fp64 product as closely as the CUTLASS build's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import OFF, Pdl
from .pdl_triton import launch, wait_for_predecessor
from .skinny_triton import SkinnyTile
from .triton_compile import compiling

_COMPILED: set = set()  # (device, config, Pdl, experts) whose binaries compile_rows made


@dataclass(frozen=True)
class GroupedSkinnyTile(SkinnyTile):
    """The dense skinny kernel's launch shape with the rows of one expert's tile (the dense kernel pads all the
    call's rows into one)."""

    block_m: int

    def label(self) -> str:
        return f"{self.block_m}x{super().label()}"


# (most rows in one group, launch shape) by epilogue (True: SwiGLU, the MoE's GEMM 1): chosen by
# bench/bench_grouped_skinny.py on the H200 (BENCHMARKS.md "Seventeenth session") from 12 shapes (BLOCK_M 16/32/64,
# BLOCK_N 32/64, BLOCK_K 256, 3/4 stages, 4 warps) at 1-64 decode tokens routed at random and all to the same 8
# experts. With groups of up to 16 rows the 16-row tile ran 1.00-1.21x (SwiGLU, 4 stages) and 1.08-1.27x (plain,
# 3 stages) the faster CUTLASS build; 32-row groups were even at best (0.95-1.06x with 32-row tiles) and 64-row
# groups slower (0.83-0.87x), so larger groups keep the CUTLASS builds.
TILES = {True: ((16, GroupedSkinnyTile(block_m=16, block_n=64, block_k=256, warps=4, stages=4)),),
         False: ((16, GroupedSkinnyTile(block_m=16, block_n=64, block_k=256, warps=4, stages=3)),)}


def tile_bound(rows: int, experts: int, block_m: int) -> int:
    """An upper bound on the (expert, row block) tiles of ``rows`` rows over ``experts`` groups: at most
    ``min(experts, rows)`` groups hold rows and ceil(c / B) <= floor((c - 1) / B) + 1, whose sum over the groups
    is at most floor(rows / B) + (groups with rows)."""
    return min(experts, rows) + rows // block_m


@triton.jit
def _expert_tile(offs_ptr, t, E, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile ``t``'s expert, first row and the expert's end row (expert == E: past the last tile)."""
    ei = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + tl.minimum(ei, E - 1))
    starts = tl.where(ei == 0, 0, tl.load(offs_ptr + tl.maximum(tl.minimum(ei, E) - 1, 0)))
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # 0 for the experts past E (ends == starts there)
    cum = tl.cumsum(tiles, 0)
    e = tl.sum((cum <= t).to(tl.int32), 0)
    mine = ei == e
    first = tl.sum(tl.where(mine, starts, 0), 0) + (t - tl.sum(tl.where(mine, cum - tiles, 0), 0)) * BLOCK_M
    return e, first, tl.sum(tl.where(mine, ends, 0), 0)


@triton.jit
def _grouped_skinny_fp8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, offs_ptr, y_ptr, N, K, E, BLOCK_E: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               SWIGLU: tl.constexpr, PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Columns ``[pid0 * BLOCK_N, +BLOCK_N)`` of tile ``pid1``'s rows (one expert's), the whole K in one program."""
    wait_for_predecessor(PDL, TRIGGER)
    e, first, end = _expert_tile(offs_ptr, tl.program_id(1), E, BLOCK_E, BLOCK_M)
    if e < E:
        rm = first + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mm = rm < end
        x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
        w_ptrs = w_ptr + (e.to(tl.int64) * N + rn.to(tl.int64))[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs, mask=mm[:, None], other=0.0), tl.load(w_ptrs), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        xs = tl.load(xs_ptr + rm, mask=mm, other=0.0)
        y = acc * xs[:, None] * tl.load(ws_ptr + e * N + rn)[None, :]  # the CUTLASS epilogue's order
        if SWIGLU:
            x1, x2 = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))
            rh = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            tl.store(y_ptr + rm[:, None] * (N // 2) + rh[None, :], (x1 * (x2 / (1.0 + tl.exp(-x2)))).to(tl.bfloat16),
                     mask=mm[:, None])
        else:
            tl.store(y_ptr + rm[:, None] * N + rn[None, :], y.to(tl.bfloat16), mask=mm[:, None])


class GroupedSkinnyFp8:
    """The kernel where no group holds more than ``max_rows`` rows (the caller's ``group_rows`` bound, else all
    the rows; ``fits``), launched with the first shape of ``tiles`` (most rows in one group, tile; default the
    measured ``TILES`` of the epilogue) that holds a whole group; ``swiglu``: the SwiGLU epilogue. Called as
    ``cutlass_grouped.CutlassGroupedFp8`` is, plus ``group_rows``."""

    def __init__(self, max_rows: int, swiglu: bool = False, tiles=None, pdl: Pdl = OFF):
        self.tiles, self.swiglu, self.pdl = tiles or TILES[swiglu], swiglu, pdl
        self.max_rows = min(max_rows, self.tiles[-1][0])
        shapes = ",".join(t.label() for _, t in self.tiles)
        self.config = f"triton-skinny[{shapes},<={self.max_rows}]{'_swiglu' if swiglu else ''}"
        self.name = f"grouped-fp8[{self.config}]"

    def tile_for(self, most: int) -> GroupedSkinnyTile | None:
        """The tile for groups of at most ``most`` rows; None past the largest."""
        return next((t for limit, t in self.tiles if most <= limit), None)

    def launches(self) -> list[int]:
        """One row count per binary up to ``max_rows`` rows (a row count each tile takes): the tile's constexprs
        change with the rows; ``R``, ``N``, ``K`` and ``E`` are arguments, and each launch compiles the PDL classes
        of its signature together (``pdl_triton.launch``)."""
        rows, below = [], 0
        for limit, _ in self.tiles:
            if below < self.max_rows:
                rows.append(min(limit, self.max_rows))
            below = limit
        return rows

    def compile_rows(self, num_experts: int, device: str | torch.device = "cuda") -> int:
        """One call per binary (``launches``) on small zero operands of the real dtypes over ``num_experts``
        groups (the MoE's stack: ``E`` sizes the constexpr ``BLOCK_E``), so Triton compiles them at build time and
        not in the first prompt of at most ``max_rows`` tokens: after an image server's warm-up, whose prompt is
        longer, a 3-word prompt (7 tokens a row, 14 with CFG) compiled these two (SwiGLU and plain) in its prefill,
        0.79-0.91 s on the H200 against 0.05-0.08 s for a longer one (BENCHMARKS.md, "Thirty-fourth session").
        ``N`` and ``K`` are one tile's, multiples of 16 like the model's, so the same binaries serve it. Once per
        device, kernel, PDL policy and expert count in a process; returns the calls."""
        device = torch.device(device)
        index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
        key = (device.type, index, self.config, self.pdl, num_experts)
        if key in _COMPILED:
            return 0
        N, K = max(t.block_n for _, t in self.tiles), max(t.block_k for _, t in self.tiles)
        e4m3, rows = torch.float8_e4m3fn, self.launches()
        w, ws = torch.zeros(num_experts, N, K, device=device).to(e4m3), torch.ones(num_experts, N, device=device)
        with compiling():  # compiled in parallel, not run
            for r in rows:
                offs = torch.full((num_experts,), r, dtype=torch.int32, device=device)  # every row in group 0
                self(torch.zeros(r, K, device=device).to(e4m3), torch.ones(r, device=device), w, ws, offs, group_rows=r)
        _COMPILED.add(key)
        return len(rows)

    def fits(self, xq_RK: torch.Tensor, wq_ENK: torch.Tensor, group_rows: int | None = None, **_) -> bool:
        """Whether this kernel takes the call: CUDA rows, no group over ``max_rows`` (``group_rows`` bounds them,
        else every row may be in one), K and N whole multiples of the tile's (shapes only, read on the host:
        capture-safe)."""
        (rows, K), (_, N, _) = xq_RK.shape, wq_ENK.shape
        most = min(rows, group_rows or rows)
        if not (xq_RK.is_cuda and rows > 0 and most <= self.max_rows):
            return False
        t = self.tile_for(most)
        return K % t.block_k == 0 and N % t.block_n == 0

    def __call__(self, xq_RK, xs_R, wq_ENK, ws_EN, offs_E, *, out=None, group_rows: int | None = None,
                 **_) -> torch.Tensor:
        """e4m3 rows ``[R, K]`` (+ fp32 ``[R]`` scales) x e4m3 experts ``[E, N, K]`` (+ fp32 ``[E, N]``) -> bf16
        ``[R, N]`` (``[R, N / 2]`` with ``swiglu``); ``out``: written in place when given; ``group_rows``: no group
        has more rows (default R; larger groups span row blocks, each reading the weight). Other keywords (the
        CUTLASS kernel's tile order) do not apply here."""
        (R, K), (E, N, _) = xq_RK.shape, wq_ENK.shape
        if out is None:
            out = torch.empty(R, N // 2 if self.swiglu else N, dtype=torch.bfloat16, device=xq_RK.device)
        if R == 0:
            return out
        t = self.tile_for(min(R, group_rows or R)) or self.tiles[-1][1]
        grid = (N // t.block_n, tile_bound(R, E, t.block_m))
        launch(_grouped_skinny_fp8_kernel, grid, self.pdl, R, xq_RK, xs_R, wq_ENK, ws_EN, offs_E, out, N, K, E,
               BLOCK_E=triton.next_power_of_2(E), BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
               SWIGLU=self.swiglu, num_warps=t.warps, num_stages=t.stages)
        return out
