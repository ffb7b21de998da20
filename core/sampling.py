"""Next-token sampling for text rows: temperature, top-k, top-p, greedy; stateless per token.

Each draw uses a generator seeded from ``(seed, index)``: a token depends on
the request's seed and its own position only, never on the other requests of
a batch or on how many draws came before on a shared generator, and a step
retried after a failure draws the same token again.

Shape suffixes: V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B1  # spreads consecutive (seed, index) pairs over generator seeds


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.6
    top_k: int = 1024
    top_p: float = 0.95

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling: temperature >= 0, top_k >= 0 and 0 < top_p <= 1 required, got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def filtered_probs(logits_V: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """fp32 probabilities after temperature, top-k (0 = off) and top-p (the smallest set reaching top_p)."""
    scores = logits_V.float() / p.temperature
    if 0 < p.top_k < scores.numel():
        kth = scores.topk(p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        outside = sorted_p.cumsum(0) - sorted_p >= p.top_p  # keep every token until the mass is reached
        # every entry written back (the kept ones unchanged): indexing with the mask would wait for the device
        probs = probs.scatter(0, order, sorted_p.masked_fill(outside, 0.0))
        probs = probs / probs.sum()
    return probs


def draw(logits_V: torch.Tensor, p: SamplingParams, seed: int, index: int) -> torch.Tensor:
    """The token at generation ``index`` of a request with ``seed`` (greedy: the first argmax), as a 0-d
    tensor on the logits' device: callers read every row's token with one host sync."""
    if p.greedy:
        return logits_V.argmax()
    g = torch.Generator(device=logits_V.device).manual_seed((seed * _MIX + index) % (2**63 - 1))
    return torch.multinomial(filtered_probs(logits_V, p), 1, generator=g)[0]
