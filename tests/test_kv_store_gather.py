"""The KV pool's fused store + gather (``KVPool.store_gather``, the glue's ``store_gather_kv``) on the CPU.

A context whose pool has a fused kernel must leave the pool and return the
key tables exactly as the pool's own two torch ops do (``index_copy_``, then
an index): several rows, a run that does not write, a padded key table. The
kernel here is the one-pass semantics in torch (``one_pass``: keys written
now come from the new rows, as ``fresh_S`` says), so a wrong ``fresh_S``
shows as a wrong key table. The cuda platform's Triton kernel is held to the
same by the conformance suite (tests/conformance/test_conformance_glue.py,
on the device).
"""
from __future__ import annotations

import torch

from omni.kv_pool import KVPool, PoolContext, Run, fresh_rows

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4


def one_pass(k_pool, v_pool, k_TKH, v_TKH, write_T, gather_S, fresh_S):
    """The fused kernel's semantics: each table row from the new row ``fresh_S`` names, else from the pool as it
    was; then the new rows stored."""
    new = (fresh_S >= 0)[:, None, None]
    k_SKH = torch.where(new, k_TKH[fresh_S.clamp_min(0)], k_pool[gather_S])
    v_SKH = torch.where(new, v_TKH[fresh_S.clamp_min(0)], v_pool[gather_S])
    k_pool.index_copy_(0, write_T, k_TKH)
    v_pool.index_copy_(0, write_T, v_TKH)
    return k_SKH, v_SKH


def _pool(store_gather=None) -> KVPool:
    pool = KVPool(num_layers=LAYERS, num_pages=12, page_size=PAGE, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                  dtype=torch.bfloat16, device="cpu", store_gather=store_gather)
    g = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return pool


def _runs(pool: KVPool) -> list[Run]:
    a, b = pool.allocate(11), pool.allocate(9)  # two rows: a 6-token prefix, then their new tokens
    return [Run(tuple(a), 6, 7, 7, write=False), Run(tuple(a), 7, 11, 11), Run(tuple(b), 5, 9, 9)]


def test_a_fused_pool_stores_and_gathers_as_the_torch_ops_do():
    plain, fused = _pool(), _pool(one_pass)
    runs = _runs(plain)
    assert _runs(fused) == runs  # the same pages in both pools
    T = sum(r.q_len for r in runs if r.write)
    for layer in range(LAYERS):
        g = torch.Generator().manual_seed(10 + layer)
        k, v = (torch.randn(T, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
        ctx_plain = PoolContext(plain, runs, mask="none", paged=False, device="cpu", keys_to=32)
        ctx_fused = PoolContext(fused, runs, mask="none", paged=False, device="cpu", keys_to=32)
        assert ctx_plain.fresh_S is None and ctx_fused.fresh_S is not None
        k_p, v_p, meta = ctx_plain.keys_values(layer, k, v)
        k_f, v_f, _ = ctx_fused.keys_values(layer, k, v)
        assert k_f.shape == (32, KV_HEADS, HEAD_DIM) and torch.equal(k_f, k_p) and torch.equal(v_f, v_p)
        assert meta.cu_seqlens_k_host == (0, 7, 18, 27)
    assert torch.equal(fused.k, plain.k) and torch.equal(fused.v, plain.v)


def test_fresh_rows_name_the_new_row_of_each_slot_written_now():
    write = torch.tensor([12, 4, 13, 5])
    gather = torch.tensor([0, 4, 5, 6, 12, 13, 0])
    assert fresh_rows(write, gather).tolist() == [-1, 1, 3, -1, 0, 2, -1]
    assert fresh_rows(torch.tensor([3]), torch.tensor([2, 3, 4])).tolist() == [-1, 0, -1]


def test_a_forward_that_writes_nothing_or_a_paged_pool_takes_the_torch_ops():
    pool = _pool(one_pass)
    pages = pool.allocate(8)
    reader = PoolContext(pool, [Run(tuple(pages), 6, 8, 8, write=False)], mask="none", paged=False, device="cpu")
    paged = PoolContext(pool, [Run(tuple(pages), 6, 8, 8)], mask="none", paged=True, device="cpu")
    assert reader.fresh_S is None and paged.fresh_S is None
