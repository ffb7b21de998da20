"""Graph capture of the denoising step (``omni.step_graphs``) on the CPU.

- the reference platform refuses capture with its reason: ``strict`` (the recipe path) raises,
  otherwise the step runs eagerly and keeps the refusal; a ``graph.mode: capture`` pipeline on
  the reference fails at build, naming the refused capturable attention;
- the bookkeeping against a recording runner: one capture per batch signature, replays while it
  holds, tables copied in place when the same signature comes back on other KV pages, LRU eviction.
The captured run equals the eager one on CUDA: tests/gpu/test_gpu_moe_and_step_graphs.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omni.kv_pool import KVPool, PoolContext, Run
from omni.platform_manager import PlatformError, select
from omni.step_graphs import StepGraphs, batch_signature, padded_keys, static_tensors, step_key


def test_reference_refuses_capture_with_its_reason():
    with pytest.raises(PlatformError, match=r"(?s)graph\.mode=capture: .*reference: runs eagerly"):
        StepGraphs(select("cpu"), "cpu")


def test_non_strict_falls_back_to_eager_and_keeps_the_reason():
    graphs = StepGraphs(select("cpu"), "cpu", strict=False)
    assert not graphs.enabled and "reference: runs eagerly" in graphs.refusal
    x = torch.randn(3, 4)
    y = graphs.run(((), ()), x, lambda x, a, b: x * a + b, lambda: (2.0, 1.0))
    assert torch.equal(y, x * 2 + 1) and graphs.captures == 0


def test_capture_recipe_on_the_reference_fails_at_build():
    from omni.recipe import load_recipe
    from omni.models.hunyuan_image3.build import build_pipeline

    recipe = load_recipe("cpu_tiny").replace_paths({"graph.mode": "capture"})
    with pytest.raises(PlatformError, match="not capturable"):
        build_pipeline(recipe, select("cpu"), progress=False)


class RecordingRunner:
    """Runs ``fn`` at capture and again at every replay (what a graph does, minus the graph)."""

    def __init__(self, spec):
        self.spec, self.fn = spec, None

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


class FakePlatform:
    def __init__(self):
        self.specs = []

    def graph_runner(self, spec):
        self.specs.append(spec)
        return RecordingRunner(spec)


def test_step_graphs_tell_the_platform_which_collectives_each_region_records():
    """A tensor-parallel step holds all-reduces: the probe and every capture name their backend to the platform."""
    platform = FakePlatform()
    graphs = StepGraphs(platform, "cpu", collectives="nccl")
    x = torch.randn(4, 2)
    y = graphs.run(((("sig",),), ()), x, lambda x, a: x + a, lambda: (torch.ones(()),))
    assert torch.equal(y, x + 1)
    assert [s.collectives for s in platform.specs] == ["nccl", "nccl"]
    assert StepGraphs(FakePlatform(), "cpu").collectives == ""


def _pool_ctx(pool, pages, P, n):
    runs = [r for p in pages for r in (Run(p, P, P + 1, P + 1), Run(p, P + 1, P + n, P + n))]
    return PoolContext(pool, runs, "none", False, "cpu")


def test_one_capture_per_signature_rebind_and_lru():
    pool = KVPool(num_layers=1, num_pages=16, page_size=8, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device="cpu")
    pf = FakePlatform()
    graphs = StepGraphs(pf, "cpu", max_graphs=2)
    P, n = 5, 7

    def forward(x, scale, ctx):  # output depends on the input and on the slots the context holds
        return x * scale + ctx.write_slots.float().sum()

    def states(pages_list, shape=(P, 2, 3)):
        return [SimpleNamespace(rows=[SimpleNamespace(seq=SimpleNamespace(prefix_len=shape[0], token_h=shape[1],
                                                                          token_w=shape[2]), pages=p)
                                      for p in pages_list])]

    a = [tuple(pool.allocate(P + n)) for _ in range(2)]
    b = [tuple(pool.allocate(P + n)) for _ in range(2)]
    x = torch.randn(2 * n, 4)
    for pages in (a, a, b, a):
        st = states(pages)
        y = graphs.run(step_key(st), x, forward, lambda p=pages: (torch.tensor(3.0), _pool_ctx(pool, p, P, n)))
        assert torch.allclose(y, forward(x, 3.0, _pool_ctx(pool, pages, P, n)))
    assert graphs.captures == 1 and graphs.rebinds == 2 and graphs.replays == 4
    assert batch_signature(states(a)) == ((P, 2, 3), (P, 2, 3))
    for shape in ((P, 1, 6), (P + 1, 2, 3)):  # two more signatures: the first graph is evicted
        graphs.run(step_key(states(a, shape)), x, forward, lambda: (torch.tensor(1.0), _pool_ctx(pool, a, P, n)))
    assert graphs.captures == 3 and len(graphs._graphs) == 2
    assert {s.pool_id for s in pf.specs[1:]} == {graphs.pool_id}, "every capture draws on the object's one pool"
    assert StepGraphs(pf, "cpu").pool_id != graphs.pool_id, "another StepGraphs (the VAE's) has its own pool"


def _states(rows):
    """``rows``: (prefix_len, pages) per row of one request with a 2x3 image."""
    return [SimpleNamespace(rows=[SimpleNamespace(seq=SimpleNamespace(prefix_len=P, token_h=2, token_w=3), pages=pg,
                                                  tokens=P + 7) for P, pg in rows])]


@pytest.mark.parametrize("paged", [True, False])
def test_padded_tables_let_prompt_lengths_share_one_graph(paged):
    """Under a key bucket, requests of other prompt lengths replay the graph with their own tables copied in."""
    pool = KVPool(num_layers=1, num_pages=32, page_size=8, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device="cpu")
    graphs = StepGraphs(FakePlatform(), "cpu", key_bucket=64)

    def forward(x, ctx):  # depends on every table the context holds
        t = ctx.meta.block_table_BP if paged else ctx.gather_S
        return x + t.float().sum() + ctx.write_slots.float().sum() + ctx.meta.cu_seqlens_k_B1.float().sum()

    n, results = 7, []
    for P in (5, 13, 20):  # three prompt lengths, one bucket
        pages = [tuple(pool.allocate(P + n)) for _ in range(2)]
        runs = [Run(pg, P, P + n, P + n) for pg in pages]
        keys_to = padded_keys(runs, graphs.key_bucket, paged, pool.page_size)
        ctx = lambda runs=runs, k=keys_to: PoolContext(pool, runs, "none", paged, "cpu", keys_to=k)  # noqa: E731
        x = torch.randn(2 * n, 4)
        y = graphs.run(step_key(_states([(P, pg) for pg in pages]), keys_to), x, lambda x, c: forward(x, c),
                       lambda c=ctx: (c(),))
        results.append(torch.equal(y, forward(x, ctx())))
        unpadded = PoolContext(pool, runs, "none", paged, "cpu")
        assert ctx().meta.max_seqlen_k >= unpadded.meta.max_seqlen_k and keys_to == 64
    assert results == [True] * 3 and graphs.captures == 1 and graphs.rebinds == 2


def test_without_a_bucket_every_prompt_length_is_its_own_signature():
    a, b = _states([(5, (0,)), (5, (1,))]), _states([(6, (0,)), (6, (1,))])
    assert step_key(a)[0] != step_key(b)[0]
    assert step_key(a, 64)[0] == step_key(b, 64)[0] and step_key(a, 64)[1] != step_key(b, 64)[1]


@pytest.mark.parametrize("paged", [True, False])
def test_padding_does_not_change_attention(paged):
    """Keys past the padded tables' true lengths are never attended (reference attention on the pool)."""
    from omni.specs import AttentionSpec

    pool = KVPool(num_layers=1, num_pages=16, page_size=8, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device="cpu")
    pool.k.normal_(), pool.v.normal_()
    attn = select("cpu").attention(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                                                 mask="none", paged=paged, page_size=8 if paged else 0))
    runs = [Run(tuple(pool.allocate(P + 5)), P, P + 5, P + 5) for P in (3, 11)]
    q = torch.randn(10, 4, 8)
    k_new, v_new = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    outs = []
    for keys_to in (0, padded_keys(runs, 48, paged, pool.page_size)):
        ctx = PoolContext(pool, runs, "none", paged, "cpu", keys_to=keys_to)
        outs.append(attn(q, *ctx.keys_values(0, k_new, v_new)))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_static_tensors_walks_contexts_and_skips_modules():
    pool = KVPool(num_layers=1, num_pages=4, page_size=8, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device="cpu")
    ctx = _pool_ctx(pool, [tuple(pool.allocate(12))], 5, 7)
    found = static_tensors((torch.zeros(1), ctx, torch.nn.Linear(2, 2)))
    assert any(t is ctx.write_slots for t in found) and any(t is ctx.meta.cu_seqlens_q_B1 for t in found)
    assert any(t is pool.k for t in found) and len(found) >= 6
