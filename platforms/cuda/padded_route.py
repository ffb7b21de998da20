"""The stable sort by expert in DeepGEMM's contiguous layout: every expert's rows start at a multiple of ``align``.

DeepGEMM's contiguous grouped GEMM (``deepgemm_moe``) reads one expert id per row and computes each ``align``-row
block with the expert of its first row, skipping blocks whose first row is padding (-1). This module is the
layout's torch definition; ``route_triton.TritonSort.route_padded`` makes the same tensors inside the counting
sort, where these torch ops cost 0.24 ms a layer on an H100 (BENCHMARKS.md, "Forty-fourth session").
The layout is sized for the worst case (``padded_capacity``), so nothing is read on the host: capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def padded_capacity(rows: int, experts: int, align: int) -> int:
    """Rows of the padded layout for ``rows`` sorted rows: rounding each expert's block up to ``align`` adds at
    most ``align - 1`` rows each. A bound from the shapes alone, so no group size is read on the host."""
    return -(-(rows + experts * (align - 1)) // align) * align


@dataclass(frozen=True)
class PaddedRoute:
    """The sort by expert with each expert's block starting at a multiple of the alignment."""

    token_M: torch.Tensor  # int64: each padded row's token (token 0 for padding: a real row nobody reads back)
    expert_M: torch.Tensor  # int32: each padded row's expert, -1 for padding
    inverse_R: torch.Tensor  # int64: each assignment's (t*k + j) padded row


def padded_rows(token_R: torch.Tensor, offsets_E: torch.Tensor, align: int) -> tuple:
    """Sorted rows (``token_R``, group ends ``offsets_E``) -> ``(token_M, expert_M, row_R)``: expert e's block
    starts at the sum of the earlier blocks' sizes, each rounded up to ``align``; ``row_R``: each sorted row's
    padded row."""
    ends_E = offsets_E.long()
    counts_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    padded_E = (counts_E + align - 1) // align * align
    shift_E = (padded_E.cumsum(0) - padded_E) - (ends_E - counts_E)  # each block's padded start minus its start
    r = torch.arange(token_R.numel(), device=token_R.device)
    expert_R = torch.searchsorted(ends_E, r, right=True)  # the first group ending after row r
    row_R = r + shift_E[expert_R]
    M = padded_capacity(token_R.numel(), ends_E.numel(), align)
    expert_M = torch.full((M,), -1, dtype=torch.int32, device=token_R.device)
    expert_M[row_R] = expert_R.int()
    token_M = torch.zeros(M, dtype=token_R.dtype, device=token_R.device)
    token_M[row_R] = token_R
    return token_M, expert_M, row_R


def torch_route_padded(ids_Tk: torch.Tensor, num_experts: int, align: int) -> PaddedRoute:
    """The padded sort as torch ops: the stable sort (``moe.torch_route_rows``), then ``padded_rows``."""
    from .moe import torch_route_rows  # moe imports this module at its top

    token_R, inverse_R, offsets_E = torch_route_rows(ids_Tk, num_experts)
    token_M, expert_M, row_R = padded_rows(token_R, offsets_E, align)
    return PaddedRoute(token_M, expert_M, row_R[inverse_R])
