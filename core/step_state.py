"""What the step engine keeps per request between steps: its rows, their KV pages, its latents and sigmas.

``StepBlock`` is the input of one packed step forward; ``common_prefix`` says how much of a row's prefix a
finished CoT pass already wrote into the pages it hands over.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_pool import Run
from .request import ImageRequest, StageTimes
from .step_cache import StepCache
from .step_model import RowSpec


@dataclass
class Row:
    """One row of a request on this worker and the KV pages holding its keys."""

    seq: RowSpec
    pages: list[int]
    block_len: int
    block_rope: tuple | None = None  # (cos_TH, sin_TH) of the step block, built once on the device
    cached: int = 0  # prefix positions whose K/V the pages already hold (a CoT pass wrote them)

    @property
    def tokens(self) -> int:  # prefix + step block: what the pages hold
        return self.seq.prefix_len + self.block_len


@dataclass
class RequestState:
    request: ImageRequest
    rows: list[Row]  # the rows this worker computes
    latents_1Chw: torch.Tensor  # fp32
    sigmas: torch.Tensor  # [steps + 1] fp32, on the host
    seed: int
    total_rows: int  # rows of the request on all workers
    step: int = 0
    times: StageTimes = field(default_factory=StageTimes)
    cache: StepCache = field(default_factory=lambda: StepCache(0.0))
    reserved: list = field(default_factory=list)  # pages held for later rows (none for an image pass)

    @property
    def done(self) -> bool:
        return self.step >= len(self.sigmas) - 1

    @property
    def sigma(self) -> float:
        return float(self.sigmas[self.step])

    @property
    def edge(self) -> bool:
        """The first or the last step: always computed, never served by the step cache."""
        return self.step == 0 or self.step == len(self.sigmas) - 2


@dataclass
class StepBlock:
    """The input of one packed step forward: tokens, per-row rope tables and attention runs, in order."""

    x_TD: torch.Tensor
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # (cos_TH, sin_TH) per row
    runs: list[Run]

    @classmethod
    def pack(cls, blocks: list["StepBlock"]) -> "StepBlock":
        return cls(torch.cat([b.x_TD for b in blocks]), [t for b in blocks for t in b.ropes],
                   [r for b in blocks for r in b.runs])

    def rope_TH(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([c for c, _ in self.ropes]), torch.cat([s for _, s in self.ropes])


def common_prefix(fed: tuple, seq) -> int:
    """Leading positions where ``seq`` has the (token, rope position) pairs the CoT row wrote."""
    n = 0
    for (tok, pos), t2, p2 in zip(fed, seq.ids[: seq.prefix_len], seq.pos_yx):
        if tok != t2 or tuple(pos) != tuple(p2):
            break
        n += 1
    return n
