"""Captured decode steps of text rows (``StepEngine.text_graphs``) on the CPU, against a recording runner.

Under ``graph.mode: capture`` an Instruct pipeline records the text rows'
decode forward (one query a row) per row count and key bucket, and replays it
with every token's tables copied in. Here the tiny golden Instruct model runs
two answers (T2T and I2T together) eagerly and then through ``text_graphs``
backed by a runner that re-runs the recorded call on its static arguments at
every replay, as a graph does: the same tokens, one capture per row count.
The paged reference attention reads its key lengths from the tables' tensors,
as the CUDA kernels do (``reads_host_lengths = False``); the gathered one reads
host lengths, which is why such pipelines keep their decode steps eager
(``build.text_graphs`` -> None). On the GPU: tests/gpu/test_gpu_text_graphs.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from golden_utils import instruct_engine
from omni.request import TextRequest
from omni.step_graphs import StepGraphs, text_key
from omni.kv_pool import Run
from test_step_graphs import FakePlatform

TOKENS = 24


@pytest.fixture(scope="module")
def engine(instruct_checkpoint):
    return instruct_engine(instruct_checkpoint, **{"kv_cache.page_tokens": 5})


def answers(meta, g, cases=("T2T", "I2T")) -> list[TextRequest]:
    out = []
    for case in cases:
        c = meta["cases"][case]
        out.append(TextRequest(prompt=c["prompt"], system_prompt=c["system_prompt"] or None, max_tokens=TOKENS,
                               temperature=0.0, stop_ids=(), seed=c.get("seed", 0),  # the seed draws the image latents
                               images=tuple(g[f"IMG.{n}.source_rgb_uint8"].numpy() for n in c["images"])))
    return out


def run(engine, requests) -> list[list[int]]:
    states = [engine.admit(r) for r in requests]
    try:
        engine.prefill(states)
        while not all(s.done for s in states):
            engine.denoise_step(states)
        return [list(s.tokens) for s in states]
    finally:
        for s in states:
            engine.release(s)


def test_captured_decode_steps_give_the_eager_tokens(engine, instruct_g):
    meta, g = instruct_g
    eager = run(engine, answers(meta, g))
    engine.text_graphs = graphs = StepGraphs(FakePlatform(), "cpu", name="text_decode", key_bucket=16)
    try:
        captured = run(engine, answers(meta, g))
        assert captured == eager and len(eager[0]) == TOKENS
        # paged: the key tables span the pages admitted for prompt + max_tokens, so one bucket a whole answer
        assert graphs.captures == 1 and graphs.replays == TOKENS - 1 and graphs.rebinds == TOKENS - 2
        alone = run(engine, answers(meta, g, ("T2T",)))
        assert alone == eager[:1] and graphs.captures == 2, "another row count is another graph"
    finally:
        engine.text_graphs = None
    assert engine.pool.free_pages == engine.pool.num_pages


def test_text_key_holds_the_row_count_and_bucket_not_the_positions():
    a = [Run((1, 2), 7, 8, 8), Run((3,), 4, 5, 5)]
    b = [Run((4, 5), 9, 10, 10), Run((6,), 2, 3, 3)]
    assert text_key(a, 64)[0] == text_key(b, 64)[0] == ("text", 2, 64)
    assert text_key(a, 64)[1] != text_key(b, 64)[1]
    assert text_key(a, 64)[0] != text_key(a[:1], 64)[0] != text_key(a[:1], 128)[0]


@pytest.mark.parametrize("host_lengths", [True, False])
def test_decode_steps_are_captured_only_where_the_attention_reads_device_lengths(host_lengths):
    from omni.models.hunyuan_image3.build import KEY_BUCKET, text_graphs

    attn = SimpleNamespace(reads_host_lengths=host_lengths)
    model = SimpleNamespace(model=SimpleNamespace(
        layers=[SimpleNamespace(self_attn=SimpleNamespace(attn={"none": attn}))]))
    graphs = text_graphs(FakePlatform(), "cpu", model, SimpleNamespace(step_collectives=""))
    if host_lengths:
        assert graphs is None
    else:
        assert graphs.key_bucket == KEY_BUCKET and graphs.name == "text_decode" and graphs.enabled


def test_answers_joining_and_finishing_share_row_bucket_graphs(engine, instruct_g):
    """Five answers of different lengths: the row count falls 5 -> 1 as they finish. Captured steps run the
    row bucket (5 -> 8 rows, copies of row 0), keep the eager tokens, and capture once per bucket."""
    meta, g = instruct_g
    c = meta["cases"]["T2T"]
    reqs = lambda: [TextRequest(prompt=f"{c['prompt']} {'red ' * i}", max_tokens=6 + 3 * i,  # noqa: E731
                                temperature=0.0, seed=i, stop_ids=()) for i in range(5)]
    eager = run(engine, reqs())
    engine.text_graphs = graphs = StepGraphs(FakePlatform(), "cpu", name="text_decode", key_bucket=16)
    try:
        assert [engine.text_rows_to(n) for n in (1, 4, 5, 8, 9)] == [1, 4, 8, 8, 16]
        assert run(engine, reqs()) == eager and [len(t) for t in eager] == [6, 9, 12, 15, 18]
        assert graphs.captures == 5, "row buckets 8, 4, 3, 2, 1"
        engine.text_row_buckets = False
        assert engine.text_rows_to(5) == 5
    finally:
        engine.text_graphs, engine.text_row_buckets = None, True
    assert engine.pool.free_pages == engine.pool.num_pages


def test_row_and_key_buckets():
    from omni.step_graphs import geometric_keys, row_bucket

    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 33)] == [1, 2, 3, 4, 8, 8, 16, 32, 64]
    assert [geometric_keys(k, 1024) for k in (0, 1024, 2048, 3072, 4096, 5120)] == [0, 1024, 2048, 4096, 4096, 8192]
