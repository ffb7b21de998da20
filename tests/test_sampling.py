"""Next-token sampling: greedy, the filters, and draws that depend on (seed, index) only."""
from __future__ import annotations

import pytest
import torch

from omni.sampling import SamplingParams, draw, filtered_probs


def logits(seed: int = 0, n: int = 50) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.5  # a flat distribution


def test_greedy_is_the_argmax_and_top_k_one_is_greedy():
    x = logits()
    assert int(draw(x, SamplingParams(temperature=0.0), 1, 0)) == int(x.argmax())
    assert int(draw(x, SamplingParams(top_k=1), 7, 3)) == int(x.argmax())


def test_a_draw_depends_on_seed_and_index_only():
    x, p = logits(), SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    same = {int(draw(x, p, 5, 2)) for _ in range(5)}
    assert len(same) == 1  # no hidden generator state between calls
    spread = {int(draw(x, p, seed, 0)) for seed in range(40)} | {int(draw(x, p, 5, i)) for i in range(40)}
    assert len(spread) > 5  # other seeds and other indices draw other tokens


def test_top_k_and_top_p_keep_only_the_head_of_the_distribution():
    x = logits()
    order = x.argsort(descending=True)
    probs_k = filtered_probs(x, SamplingParams(temperature=1.0, top_k=3, top_p=1.0))
    assert set(torch.nonzero(probs_k).flatten().tolist()) == set(order[:3].tolist())
    full = torch.softmax(x, -1)
    need = int((full[order].cumsum(0) < 0.5).sum()) + 1  # the smallest head reaching 0.5
    probs_p = filtered_probs(x, SamplingParams(temperature=1.0, top_k=0, top_p=0.5))
    assert set(torch.nonzero(probs_p).flatten().tolist()) == set(order[:need].tolist())
    assert probs_p.sum().item() == pytest.approx(1.0)


def test_bad_parameters_are_refused():
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError, match="sampling"):
            SamplingParams(**bad)
