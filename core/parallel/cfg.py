"""CFG parallelism: the conditional and unconditional rows of a request on two rank groups.

Rank group 0 (cfg index 0) computes row 0 (conditional), group 1 row 1
(unconditional): each prefills and steps only its row, in its own KV pool.
After every step's forward the groups exchange their velocity predictions
(one all-gather for all running requests), so every rank combines the same
guided velocity and applies the same Euler update. The starting noise is
drawn from the request's seed on a CPU generator, hence identical on every
rank; a request without a seed gets one from the driver before it is
broadcast (``omni.parallel.driver``).

A request with one row (guidance <= 1) is computed by both groups
(redundantly: a cfg-parallel deployment serving unguided requests wastes
half its ranks) so that every rank keeps running the same forwards, which
collectives inside the model (expert all-to-all across cfg ranks) need.
"""
from __future__ import annotations

import torch


class CfgSplit:
    """Which rows a rank computes, and the per-step exchange of predictions."""

    def __init__(self, comm):
        self.comm = comm

    def rows(self, num_rows: int) -> list[int]:
        """Indices of the rows of a ``num_rows``-row request this rank computes."""
        if self.comm.size == 1 or num_rows == 1:
            return list(range(num_rows))
        if num_rows != self.comm.size:
            raise ValueError(f"cfg parallel over {self.comm.size} rank groups cannot split a {num_rows}-row request")
        return [self.comm.rank]

    def exchange(self, local: list[torch.Tensor], num_rows: list[int]) -> list[torch.Tensor]:
        """Per request, ``[rows here, ...]`` predictions -> ``[num_rows, ...]`` (all rows, in order)."""
        if self.comm.size == 1 or all(n == 1 for n in num_rows):
            return local
        flat = torch.cat([v.flatten() for v in local])
        every = self.comm.all_gather(flat)  # [cfg ranks, sum of sizes]
        out, start = [], 0
        for v, n in zip(local, num_rows):
            seg = slice(start, start + v.numel())
            start += v.numel()
            out.append(v if n == 1 else torch.stack([every[i, seg].view(v.shape[1:]) for i in range(n)]))
        return out
