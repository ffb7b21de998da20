"""Paged K/V storage shared by every request on a worker, and the per-forward contexts.

The pool holds, per layer, K and V as ``[P, G, K, H]`` (pages x tokens per
page x kv heads x head dim) inside one fixed byte budget. A request row
(one CFG row of one request) owns a list of pages; its token at row position
j lives at slot ``pages[j // G] * G + j % G``. Nothing here assumes the
prefix is text or that it is written once: a forward writes whatever tokens
it computes at their row positions, and its queries read any key range of
their row.

A forward is a list of ``Run``s: query positions ``[q_start, q_end)`` of one
row attending to that row's keys ``[0, k_end)``. ``PoolContext`` is the
attention context the model sees (``mask`` and ``keys_values``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .device import upload
from .specs import VarlenMeta


class KVPoolExhausted(RuntimeError):
    """Not enough free pages; the scheduler queues or rejects, nothing is overwritten."""


class KVPool:
    """Fixed-size paged K/V memory for ``num_layers`` layers.

    ``store_gather``: a fused kernel for the gathered (not paged) layout, the
    ``store_gather_kv`` of the platform's glue (``omni_glue_impl``): it stores
    a forward's K/V and returns its key table in one pass. None: two torch
    ops each (``index_copy_``, then an index).
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, store_gather=None):
        if num_pages < 1:
            raise ValueError("KV pool budget too small for a single page; raise kv_cache.budget_bytes")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size, self.num_pages, self.store_gather = page_size, num_pages, store_gather
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as ``[slots, kv heads, head dim]`` views (a slot: ``page * page_size + j``)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    @staticmethod
    def bytes_per_page(*, num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_budget(cls, budget_bytes: int, **kw) -> "KVPool":
        per_page = cls.bytes_per_page(**{k: kw[k] for k in ("num_layers", "page_size", "num_kv_heads", "head_dim",
                                                            "dtype")})
        return cls(num_pages=budget_bytes // per_page, **kw)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, num_tokens: int) -> list[int]:
        n = self.pages_for(num_tokens)
        if n > len(self._free):
            raise KVPoolExhausted(f"need {n} KV pages, {len(self._free)} of {self.num_pages} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def copy_prefix(self, src_pages: list[int], dst_pages: list[int], n: int) -> None:
        """Copy the K/V of row positions ``[0, n)`` from one row's pages to another's, in every layer."""
        if n <= 0:
            return
        src, dst = (self.slots(p, 0, n).to(self.k.device) for p in (src_pages, dst_pages))
        for kv in (self.k, self.v):
            flat = kv.view(kv.shape[0], -1, *kv.shape[3:])
            flat[:, dst] = flat[:, src]

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of row positions ``[start, end)`` (int64, on the host)."""
        return torch.from_numpy(row_slots(pages, start, end, self.page_size))


def row_slots(pages, start: int, end: int, page_size: int) -> np.ndarray:
    """``pages[j // page_size] * page_size + j % page_size`` for ``j`` in ``[start, end)``, as int64. In numpy:
    the tables of a decode step are built on the host for every row at every token, and a handful of small
    torch ops per row cost more than the arithmetic (bench/bench_pool_context.py)."""
    first, last = start // page_size, -(-end // page_size)
    page_slots = np.asarray(pages[first:last], dtype=np.int64)[:, None] * page_size + np.arange(page_size)
    return page_slots.reshape(-1)[start - first * page_size: end - first * page_size]


@dataclass(frozen=True)
class Run:
    """Queries at row positions ``[q_start, q_end)`` of the row owning ``pages``, keys ``[0, k_end)``."""

    pages: tuple[int, ...]
    q_start: int
    q_end: int
    k_end: int
    write: bool = True  # store this run's K/V at its positions

    @property
    def q_len(self) -> int:
        return self.q_end - self.q_start


class PoolContext:
    """Attention context of one forward over ``runs`` (in packing order) against ``pool``."""

    def __init__(self, pool: KVPool, runs: list[Run], mask: str, paged: bool, device, keys_to: int = 0):
        """``keys_to`` > 0: pad the key tables to that many keys (paged: per row; gathered: in all), so that
        forwards of other prompt lengths have tables of the same shapes (a captured step replays them)."""
        self.pool, self.mask, self.paged = pool, mask, paged
        ps = pool.page_size
        written = [row_slots(r.pages, r.q_start, r.q_end, ps) for r in runs if r.write]
        write_T = np.concatenate(written) if written else None
        gather_S = None if paged else _padded(np.concatenate([row_slots(r.pages, 0, r.k_end, ps) for r in runs]),
                                             keys_to)
        self.write_slots = None if write_T is None else upload(write_T, device)
        self.gather_S = None if gather_S is None else upload(gather_S, device)
        fused = pool.store_gather is not None and write_T is not None and gather_S is not None
        self.fresh_S = upload(_fresh_rows(write_T, gather_S), device) if fused else None
        self.meta = _meta(runs, paged, device, keys_to, pool.page_size)

    def keys_values(self, layer: int, k_TKH: torch.Tensor, v_TKH: torch.Tensor):
        k_pool, v_pool = self.pool.flat(layer)
        if self.paged:
            if self.write_slots is not None:
                store_kv(k_pool, v_pool, k_TKH, v_TKH, self.write_slots)
            return self.pool.k[layer], self.pool.v[layer], self.meta
        if self.write_slots is None:
            return k_pool[self.gather_S], v_pool[self.gather_S], self.meta
        store_gather = self.pool.store_gather or store_gather_kv  # the platform's one pass, or two torch ops
        return (*store_gather(k_pool, v_pool, k_TKH, v_TKH, self.write_slots, self.gather_S, self.fresh_S), self.meta)


def store_kv(k_pool_PKH, v_pool_PKH, k_TKH, v_TKH, write_T) -> None:
    """A forward's K/V into one layer's flat pool (``KVPool.flat``) at the slots ``write_T``."""
    k_pool_PKH.index_copy_(0, write_T, k_TKH.to(k_pool_PKH.dtype))
    v_pool_PKH.index_copy_(0, write_T, v_TKH.to(v_pool_PKH.dtype))


def store_gather_kv(k_pool_PKH, v_pool_PKH, k_TKH, v_TKH, write_T, gather_S, fresh_S=None):
    """What the glue's optional ``store_gather_kv`` computes, as two torch ops each: ``store_kv``, then the key
    table ``pool[gather_S]``. ``fresh_S`` (``fresh_rows``) only tells a one-pass kernel which keys it may read
    from the new rows; the pool computes it only when it has such a kernel."""
    store_kv(k_pool_PKH, v_pool_PKH, k_TKH, v_TKH, write_T)
    return k_pool_PKH[gather_S], v_pool_PKH[gather_S]


def fresh_rows(write_T: torch.Tensor, gather_S: torch.Tensor) -> torch.Tensor:
    """For each gathered slot, the row of this forward's K/V that is stored there, or -1 (a slot written
    before): a fused kernel reads those keys from the new rows instead of the pool it is writing."""
    return torch.from_numpy(_fresh_rows(write_T.numpy(), gather_S.numpy()))


def _fresh_rows(write_T: np.ndarray, gather_S: np.ndarray) -> np.ndarray:
    order = np.argsort(write_T, kind="stable")
    sorted_T = write_T[order]
    if not sorted_T.size:
        return np.full_like(gather_S, -1)
    at = np.searchsorted(sorted_T, gather_S).clip(max=sorted_T.size - 1)
    return np.where(sorted_T[at] == gather_S, order[at], -1)


def _cumsum(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def _padded(slots_S: np.ndarray, keys_to: int) -> np.ndarray:
    """Gathered key slots padded with slot 0 up to ``keys_to`` (past the last sequence: never attended)."""
    if keys_to <= slots_S.size:
        return slots_S  # nothing to pad (every eager step): no copy
    return np.concatenate([slots_S, np.zeros(keys_to - slots_S.size, dtype=slots_S.dtype)])


def _meta(runs: list[Run], paged: bool, device, keys_to: int = 0, page_size: int = 1) -> VarlenMeta:
    """Varlen metadata of ``runs``; ``keys_to`` > 0 pads the block table (paged) and sets ``max_seqlen_k`` to it
    (an upper bound: the kernels read the true lengths from the device tensors)."""
    cu_q, cu_k = _cumsum([r.q_len for r in runs]), _cumsum([r.k_end for r in runs])
    block_table = seqused = None
    if paged:
        width = max(max(len(r.pages) for r in runs), -(-keys_to // page_size))
        block_table = upload([list(r.pages) + [0] * (width - len(r.pages)) for r in runs], device, torch.int32)
        seqused = upload([r.k_end for r in runs], device, torch.int32)
    return VarlenMeta(cu_seqlens_q_B1=upload(cu_q, device, torch.int32),
                      cu_seqlens_k_B1=upload(cu_k, device, torch.int32),
                      max_seqlen_q=max(r.q_len for r in runs), max_seqlen_k=max([r.k_end for r in runs] + [keys_to]),
                      cu_seqlens_q_host=cu_q, cu_seqlens_k_host=cu_k,
                      block_table_BP=block_table, seqused_k_B=seqused)
