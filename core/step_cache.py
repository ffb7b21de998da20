"""Step cache (TeaCache-style): skip a request's transformer on steps where its input barely moved.

For each request the block input x (``<timestep>`` + image-token embeddings,
which carry the timestep conditioning) is compared with the previous step's:
``rel = mean|x - x_prev| / mean|x_prev|``. The relative changes accumulate;
while the sum stays below the request's threshold the backbone is skipped and
its output is taken as ``x + residual`` from the last computed step; once it
crosses, the step is computed, the residual refreshed and the sum reset. The
first and the last step are always computed. Threshold 0 turns it off.
All decisions of a step cost one host synchronisation in total.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepCache:
    threshold: float
    acc: float = 0.0
    x_prev: torch.Tensor | None = None
    residual: torch.Tensor | None = None  # backbone output - input, for this request's packed rows
    skipped: int = 0

    @property
    def enabled(self) -> bool:
        return self.threshold > 0


def rel_change(x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
    """0-d fp32 relative L1 change (stays on the device)."""
    return (x.float() - x_prev.float()).abs().mean() / x_prev.float().abs().mean().clamp_min(1e-12)


def plan_skips(caches: list[StepCache], xs: list[torch.Tensor], always: list[bool]) -> list[bool]:
    """Which requests skip this step; ``always[i]`` forces a computed step (first/last)."""
    idx = [i for i, c in enumerate(caches) if c.enabled and c.residual is not None and not always[i]]
    rels = torch.stack([rel_change(xs[i], caches[i].x_prev) for i in idx]).tolist() if idx else []
    skip = [False] * len(caches)
    for i, rel in zip(idx, rels):
        if caches[i].acc + rel < caches[i].threshold:
            skip[i] = True
            caches[i].acc += rel
    return skip


def after_step(cache: StepCache, x: torch.Tensor, h: torch.Tensor | None) -> torch.Tensor:
    """Record a computed step (``h`` given) or produce the skipped step's output."""
    cache.x_prev = x if cache.enabled else None
    if h is not None:
        if cache.enabled:
            cache.residual, cache.acc = h - x, 0.0
        return h
    cache.skipped += 1
    return x + cache.residual
