"""Captured text decode steps on CUDA: answers replayed from CUDA graphs equal the eager ones.

The embedded trained tiny Instruct model on the ``cuda`` platform with
``graph.mode: capture`` (contiguous KV, the recipe h200_instruct_fp8's layout):
the pipeline records the text rows' decode forward per row count and key
bucket (``StepEngine.text_graphs``). Two answers at once (one with an image in
its prompt), then the same with the decode graphs switched off on the same
engine: the same tokens, and logits within the difference that padding the key
tables may make (it can change how the attention kernel splits the keys). In
bf16: capture on CUDA needs the bf16 MoE kernels (an fp32 capture is refused at
build, naming them). The decode path's official answers (fp32, eager):
test_gpu_edit.py::test_text_answers_on_cuda_match_official_greedy_tokens.
"""
from __future__ import annotations

import pytest
import torch

import numpy as np

from golden_utils import instruct_on_cuda, recorded_text_logits, rel_err
from omni.request import TextRequest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

TOKENS = 40  # past the 8 the golden set holds: the key tables grow across steps, each step rebinds them


def requests() -> list[TextRequest]:
    image = np.zeros((64, 96, 3), dtype=np.uint8)
    image[16:48, 24:72] = (220, 30, 30)  # a red rectangle
    return [TextRequest(prompt="make a blue circle on the left", max_tokens=TOKENS, temperature=0.0, seed=0,
                        stop_ids=()),
            TextRequest(prompt="what colour is the shape?", max_tokens=TOKENS, temperature=0.0, seed=1, stop_ids=(),
                        images=(image,))]


def engine_on_cuda():
    """The embedded trained weights in bf16, decode steps captured."""
    return instruct_on_cuda(None, "bfloat16", **{"graph.mode": "capture"})


@torch.inference_mode()
def answer(engine, reqs: list[TextRequest]) -> tuple[list[list[int]], torch.Tensor]:
    """(tokens of every answer, every decode step's logits on the host)."""
    states = [engine.admit(r) for r in reqs]
    try:
        with recorded_text_logits(engine) as logits:
            engine.prefill(states)
            while not all(s.done for s in states):
                engine.denoise_step(states)
    finally:
        for s in states:
            engine.release(s)
    return [list(s.tokens) for s in states], torch.cat(logits[1:])  # [0]: the prefill's, never captured


def captured_then_eager(engine, make) -> tuple[list, list, float]:
    """(captured tokens, eager tokens, logits rel difference) of the requests ``make()`` on one engine."""
    graphs = engine.text_graphs
    captured, captured_logits = answer(engine, make())
    engine.text_graphs = None
    try:
        eager, eager_logits = answer(engine, make())
    finally:
        engine.text_graphs = graphs
    return captured, eager, rel_err(captured_logits, eager_logits)


def test_answers_replayed_from_decode_graphs_equal_eager():
    engine = engine_on_cuda()
    graphs = engine.text_graphs
    assert graphs is not None and graphs.enabled, "the CUDA attention reads device lengths: decode is captured"
    captured, eager, err = captured_then_eager(engine, requests)
    assert graphs.captures >= 1 and graphs.replays == TOKENS - 1 and graphs.rebinds >= TOKENS - 1 - graphs.captures
    print(f"bf16: {graphs.captures} decode graphs, {graphs.replays} replays; logits rel diff to eager {err:.2e}")
    assert captured == eager and err <= 2e-2, (err, captured, eager)


def test_answers_finishing_one_by_one_replay_row_bucket_graphs():
    """Five answers of different lengths: 5 rows run as a bucket of 8 (copies of row 0), then 4, 3, 2, 1."""
    engine = engine_on_cuda()
    reqs = lambda: [TextRequest(prompt=f"make a {'big ' * i}red square", max_tokens=8 + 6 * i,  # noqa: E731
                                temperature=0.0, seed=i, stop_ids=()) for i in range(5)]
    captured, eager, err = captured_then_eager(engine, reqs)
    assert engine.text_graphs.captures == 5 and engine.text_rows_to(5) == 8
    print(f"5 answers, row buckets: {engine.text_graphs.captures} graphs; logits rel diff to eager {err:.2e}")
    assert captured == eager and err <= 2e-2, (err, captured, eager)


def test_lookahead_steps_equal_steps_read_one_at_a_time():
    """Steps launched before the last one's tokens are read (``text_lookahead``: the unread tokens fed from
    the device, read through pinned copies and events) give the tokens and logits of steps read one at a
    time: the same graphs on the same inputs. Greedy and sampled answers of different lengths."""
    engine = engine_on_cuda()
    reqs = lambda: [TextRequest(prompt=f"make a {'big ' * i}red square", max_tokens=10 + 7 * i,  # noqa: E731
                                temperature=0.8 * (i % 2), top_k=50, seed=i, stop_ids=()) for i in range(3)]
    engine.text_lookahead = False
    one_at_a_time, sync_logits = answer(engine, reqs())
    engine.text_lookahead = True
    ahead, ahead_logits = answer(engine, reqs())
    assert [len(t) for t in ahead] == [10, 17, 24]
    assert ahead == one_at_a_time and torch.equal(ahead_logits, sync_logits)
