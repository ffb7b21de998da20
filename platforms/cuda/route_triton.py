"""Triton kernels of the CUDA MoE's stable counting sort by expert (``TritonSort``, which ``TritonKernels`` extends).

May assume: ``triton`` imports (``moe.py`` imports the Triton kernels only then) and every tensor is a contiguous
CUDA tensor. No host reads: the sort is capturable.

    route_rows     the sort of the T*k expert ids: one launch up to 32 assignments, else two (counts per block of
                   128 or 1024 rows, then places; ``route_launch.route_plan``): each sorted row's token, each
                   assignment's sorted row, the group ends
    route_padded   the same in DeepGEMM's padded layout (``padded_route``): the place kernels round each expert's
                   block up to ``ALIGN`` and name each row's expert
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe import torch_route_rows  # moe.py imports this module only from a function: no cycle
from .padded_route import PaddedRoute, padded_capacity, torch_route_padded
from .pdl_triton import launch, wait_for_predecessor
from .route_launch import (CHUNK_BLOCK, MAX_BLOCKS, MAX_EXPERTS, PLACE_BLOCKS, SMALL_CHUNK, SORT_BLOCK, route_chunk,
                           route_plan, route_variants)
from .triton_compile import compile_only, compiling

_ROUTES_COMPILED: set = set()  # (device, experts, k, alignment, Pdl) whose sorts compile_routes launched


@triton.jit(do_not_specialize=["R"])
def _count_kernel(ids_ptr, counts_ptr, R, EB: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """counts[b, e]: how many of block b's assignments route to expert e."""
    wait_for_predecessor(PDL, TRIGGER)
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + i, mask=i < R, other=EB)  # EB matches no expert column
    hit = (e[:, None] == tl.arange(0, EB)[None, :]).to(tl.int32)
    tl.store(counts_ptr + b * EB + tl.arange(0, EB), tl.sum(hit, axis=0))


@triton.jit
def _place_chunk(ids_ptr, token_ptr, inverse_ptr, expert_ptr, first, R, K, base, experts, EB: tl.constexpr,
                 CHUNK: tl.constexpr, ALIGN: tl.constexpr):
    """Places assignments ``first .. first + CHUNK``: each one's sorted row is its expert's ``base`` plus its rank
    among the earlier rows of the chunk with the same expert (index order: the sort is stable). Ranks come from a
    [CHUNK, CHUNK] comparison summed along rows: reductions only, no scan (a scan of the [rows, experts] one-hot
    matrix took 70 us a layer on the H200). Returns ``base`` advanced past the chunk's rows. The padded layout
    (``ALIGN`` > 1) also names each row's expert."""
    lanes = tl.arange(0, CHUNK)
    i = first + lanes
    m = i < R
    e = tl.load(ids_ptr + i, mask=m, other=EB)
    e_row = tl.load(ids_ptr + i, mask=m, other=EB)  # the same ids again, to lie along the other axis
    rank = tl.sum(((e[:, None] == e_row[None, :]) & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
    hit = (e[:, None] == experts[None, :]).to(tl.int32)
    pos = (tl.sum(hit * base[None, :], axis=1) + rank).to(tl.int64)
    tl.store(inverse_ptr + i, pos, mask=m)
    tl.store(token_ptr + pos, (i // K).to(tl.int64), mask=m)
    if ALIGN > 1:
        tl.store(expert_ptr + pos, e.to(tl.int32), mask=m)
    return base + tl.sum(hit, axis=0)


@triton.jit
def _block_sizes(totals, ALIGN: tl.constexpr):
    """Each expert's rows in the layout: its assignments, rounded up to ``ALIGN`` (DeepGEMM's padded layout)."""
    if ALIGN > 1:
        totals = (totals + ALIGN - 1) // ALIGN * ALIGN
    return totals


@triton.jit(do_not_specialize=["R", "NB"])
def _place_kernel(ids_ptr, counts_ptr, token_ptr, inverse_ptr, ends_ptr, expert_ptr, R, E, K, NB, EB: tl.constexpr,
                  NBT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, ALIGN: tl.constexpr = 1,
                  PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """Sorted row of each assignment of block b: its expert's start, the rows of that expert in blocks and
    chunks before it, and its rank in its chunk (``_place_chunk``). The blocks' counts are read ``NBT`` blocks
    at a time, whatever ``NB`` is: one binary for every row count (a tile of ``NB`` rounded up to a power of
    two compiled a variant per power, in the first request of each prompt length class). With ``ALIGN`` > 1
    each expert's block is rounded up to it (``padded_route``)."""
    wait_for_predecessor(PDL, TRIGGER)
    b = tl.program_id(0)
    experts = tl.arange(0, EB)
    totals = tl.zeros([EB], dtype=tl.int32)
    before = tl.zeros([EB], dtype=tl.int32)
    for first in range(0, NB, NBT):
        blocks = first + tl.arange(0, NBT)
        c = tl.load(counts_ptr + blocks[:, None] * EB + experts[None, :], mask=(blocks < NB)[:, None], other=0)
        totals += tl.sum(c, axis=0)
        before += tl.sum(tl.where((blocks < b)[:, None], c, 0), axis=0)
    sizes = _block_sizes(totals, ALIGN)
    ends = tl.cumsum(sizes, axis=0)
    base = ends - sizes + before
    for start in tl.static_range(0, BLOCK, CHUNK):
        if b * BLOCK + start < R:  # chunks past the last row are skipped
            base = _place_chunk(ids_ptr, token_ptr, inverse_ptr, expert_ptr, b * BLOCK + start, R, K, base,
                                experts, EB, CHUNK, ALIGN)
    if b == 0:
        tl.store(ends_ptr + experts, ends, mask=experts < E)


@triton.jit(do_not_specialize=["R"])
def _route_one_block_kernel(ids_ptr, token_ptr, inverse_ptr, ends_ptr, expert_ptr, R, E, K, EB: tl.constexpr,
                            RB: tl.constexpr, CHUNK: tl.constexpr, ALIGN: tl.constexpr = 1,
                            PDL: tl.constexpr = False, TRIGGER: tl.constexpr = False):
    """The whole sort of at most ``RB`` assignments in one program: the counts, then the places chunk by chunk
    (a decode step's few rows: one launch instead of the count and place kernels)."""
    wait_for_predecessor(PDL, TRIGGER)
    experts, i = tl.arange(0, EB), tl.arange(0, RB)
    e = tl.load(ids_ptr + i, mask=i < R, other=EB)  # EB matches no expert column
    sizes = _block_sizes(tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0), ALIGN)
    ends = tl.cumsum(sizes, axis=0)
    base = ends - sizes
    for start in tl.static_range(0, RB, CHUNK):
        base = _place_chunk(ids_ptr, token_ptr, inverse_ptr, expert_ptr, start, R, K, base, experts, EB, CHUNK,
                            ALIGN)
    tl.store(ends_ptr + experts, ends, mask=experts < E)


class TritonSort:
    """The sort's launches; ``self.pdl``: which calls launch with PDL (``kernels.pdl_rows``)."""

    def compile_routes(self, num_experts: int, k: int, align: int = 1) -> int:
        """Sorts ``T x k`` ids once for each launch ``route_rows`` (``align`` > 1: ``route_padded``) can make
        (``route_variants``), on the current device, so Triton compiles them all here, at build time. Without it
        the first prompt of each length class compiled its sort in that request (1.1 s of a prefill on the H200).
        Once per device, expert count, ``k``, alignment and PDL rows in a process; returns the sorts launched."""
        key = (torch.cuda.current_device(), num_experts, k, align, self.pdl)
        if num_experts > MAX_EXPERTS or key in _ROUTES_COMPILED:
            return 0
        tokens = route_variants(k, self.pdl)
        with compiling():  # compiled in parallel, not run
            for t in tokens:
                self._sort(torch.arange(t * k, device="cuda").remainder(num_experts).reshape(t, k), num_experts,
                           None, align)
        _ROUTES_COMPILED.add(key)
        return len(tokens)

    def route_rows(self, ids_Tk: torch.Tensor, num_experts: int, plan: str | None = None):
        """``(token_R, inverse_R, offsets_E)`` of the stable sort by expert, as ``route_plan`` launches it for
        these rows (``plan``: one of ``ROUTE_PLANS`` instead, for the benchmark and the tests); the torch sort
        beyond ``MAX_BLOCKS`` blocks or ``MAX_EXPERTS`` experts. Inside ``compiling()``, where the kernels did
        not run, the torch sort's too: the GEMMs and gathers after it index with them, and the torch sort bounds
        every group by the rows whatever the ids (a compile pass feeds it ids of rows no kernel wrote)."""
        out = self._sort(ids_Tk, num_experts, plan, 1)
        return torch_route_rows(ids_Tk, num_experts) if out is None or compile_only() else out[:3]

    def route_padded(self, ids_Tk: torch.Tensor, num_experts: int, align: int, plan: str | None = None):
        """The same sort in DeepGEMM's padded layout (``padded_route.PaddedRoute``: each expert's block starts
        at a multiple of ``align``, ``padded_capacity`` rows), made by the sort's own kernels: only the padding's
        two fills are added. The torch definition's ops took 0.24 ms a layer on an H100; with this sort the MoE's
        small kernels took what our CUTLASS MoE's do (0.32 against 0.30 ms, BENCHMARKS.md "Forty-fifth
        session"). As ``route_rows``
        otherwise."""
        out = self._sort(ids_Tk, num_experts, plan, align)
        if out is None or compile_only():
            return torch_route_padded(ids_Tk, num_experts, align)
        token_M, inverse_R, _, expert_M = out
        return PaddedRoute(token_M, expert_M, inverse_R)

    def _sort(self, ids_Tk: torch.Tensor, num_experts: int, plan: str | None, align: int):
        """The counting sort's launches: ``(token, inverse_R, ends_E, expert)``, padded to ``align`` where it is
        above 1 (then ``token`` and ``expert`` have ``padded_capacity`` rows, the padding's filled first, and
        ``ends_E`` ends each expert's padded block); None where the torch sort takes over."""
        ids = ids_Tk.reshape(-1).contiguous()
        R, k = ids.numel(), ids_Tk.shape[1]
        plan = plan or route_plan(R)
        block = CHUNK_BLOCK if plan == "chunks" else SORT_BLOCK
        nb = triton.cdiv(R, block)
        if not 0 < nb <= MAX_BLOCKS or num_experts > MAX_EXPERTS:
            return None
        eb = triton.next_power_of_2(num_experts)
        token, inverse_R, ends_E, expert = _sort_outputs(R, num_experts, align, ids.device)
        chunk = route_chunk(R)
        warps = 4 if chunk == SMALL_CHUNK else 8
        if plan == "one launch":  # siblings=False: compile_routes compiles each launch's classes (route_variants)
            launch(_route_one_block_kernel, (1,), self.pdl, R, ids, token, inverse_R, ends_E, expert, R,
                   num_experts, k, EB=eb, RB=max(chunk, triton.next_power_of_2(R)), CHUNK=chunk, ALIGN=align,
                   num_warps=warps, siblings=False)
            return token, inverse_R, ends_E, expert
        counts = torch.empty(nb, eb, dtype=torch.int32, device=ids.device)
        launch(_count_kernel, (nb,), self.pdl, R, ids, counts, R, EB=eb, BLOCK=block, num_warps=8, siblings=False)
        launch(_place_kernel, (nb,), self.pdl, R, ids, counts, token, inverse_R, ends_E, expert, R, num_experts, k,
               nb, EB=eb, NBT=PLACE_BLOCKS[plan], BLOCK=block, CHUNK=chunk, ALIGN=align, num_warps=warps,
               siblings=False)
        return token, inverse_R, ends_E, expert


def _sort_outputs(R: int, num_experts: int, align: int, device) -> tuple:
    """``(token, inverse_R, ends_E, expert)`` for the sort's kernels to write. Padded (``align`` > 1): the padding's
    rows are filled first (token 0, expert -1), as the sort writes only the assigned rows; otherwise ``expert`` is
    a placeholder that ``ALIGN`` 1 never writes."""
    inverse_R = torch.empty(R, dtype=torch.int64, device=device)
    ends_E = torch.empty(num_experts, dtype=torch.int32, device=device)
    if align == 1:
        return torch.empty(R, dtype=torch.int64, device=device), inverse_R, ends_E, ends_E
    M = padded_capacity(R, num_experts, align)
    return (torch.zeros(M, dtype=torch.int64, device=device), inverse_R, ends_E,
            torch.full((M,), -1, dtype=torch.int32, device=device))
