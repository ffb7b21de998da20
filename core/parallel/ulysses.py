"""Ulysses sequence parallelism: all-to-all between sequence chunks and head groups.

Each of the ``u`` ranks holds a contiguous chunk of the packed token stream
(``sizes[i]`` tokens, uneven allowed) and all of its (tp-local) heads. Around
attention, one all-to-all turns that into *all* tokens for ``1/u`` of the
heads; the unchanged kernel runs on it with the ordinary varlen metadata of
the whole forward; a second all-to-all turns the output back. K/V go through
the same exchange before they are written to the KV pool, so the pool of a
Ulysses rank holds its head group of every token: the prefix K/V written by
the (also sequence-parallel) prefill is reused, head-sharded, by every step.

KV heads: with ``K`` kv heads per tp rank, ``K % u == 0`` gives each rank
``K/u`` of them; ``u % K == 0`` gives each rank the one kv head its query
heads use (kv heads are repeated before the exchange, GQA stays exact);
anything else is refused.

Shape suffixes: T all tokens of the forward, L this rank's tokens, N/K
heads, H head dim, u ranks.
"""
from __future__ import annotations

import torch

from .mesh import MeshError


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, u: int) -> int:
    """KV heads one Ulysses rank holds (and its pool stores); refuses layouts that do not split."""
    if num_heads % u:
        raise MeshError(f"parallel.ulysses={u} must divide the query heads per tp rank ({num_heads})")
    if num_kv_heads % u == 0:
        return num_kv_heads // u
    if u % num_kv_heads == 0:
        return 1
    raise MeshError(f"parallel.ulysses={u} and {num_kv_heads} kv heads per tp rank: one must divide the other "
                    "(each Ulysses rank needs whole kv heads for its query heads)")


def seq_to_heads(x_LnH: torch.Tensor, comm, sizes: list[int]) -> torch.Tensor:
    """``[L, n, H]`` (my tokens, all heads) -> ``[T, n/u, H]`` (all tokens, my head group)."""
    u, L, n, H = comm.size, *x_LnH.shape  # explicit sizes: a rank may hold no tokens (L = 0)
    send = x_LnH.reshape(L, u, n // u, H).transpose(0, 1).reshape(u * L, n // u, H)
    return comm.all_to_all(send, [L] * u, sizes)


def heads_to_seq(x_TnH: torch.Tensor, comm, sizes: list[int]) -> torch.Tensor:
    """``[T, n/u, H]`` -> ``[L, n, H]``: the inverse of ``seq_to_heads``."""
    u, L, (_, n, H) = comm.size, sizes[comm.rank], x_TnH.shape
    recv = comm.all_to_all(x_TnH, sizes, [L] * u)
    return recv.reshape(u, L, n, H).transpose(0, 1).reshape(L, u * n, H)


class UlyssesContext:
    """Attention context of one sequence-parallel forward: exchanges K/V, then defers to ``inner``."""

    def __init__(self, inner, comm, sizes: list[int]):
        self.inner, self.comm, self.sizes, self.mask = inner, comm, sizes, inner.mask
        self.meta = None

    def keys_values(self, layer: int, k_LKH: torch.Tensor, v_LKH: torch.Tensor):
        k_TKH, v_TKH = self._kv_to_heads(k_LKH), self._kv_to_heads(v_LKH)
        k_all, v_all, self.meta = self.inner.keys_values(layer, k_TKH, v_TKH)
        return k_all, v_all, self  # the Ulysses kernel unwraps ``self.meta``

    def _kv_to_heads(self, x_LKH: torch.Tensor) -> torch.Tensor:
        u, K = self.comm.size, x_LKH.shape[1]
        if K % u:  # fewer kv heads than ranks: give each rank the kv head of its query heads
            x_LKH = x_LKH[:, [j * K // u for j in range(u)]]
        return seq_to_heads(x_LKH, self.comm, self.sizes)


class UlyssesAttention:
    """Kernel wrapper: query all-to-all, the platform's kernel on a head group, output all-to-all."""

    def __init__(self, inner):
        self.inner, self.name = inner, f"ulysses[{inner.name}]"

    def __call__(self, q_LNH: torch.Tensor, k, v, ctx: UlyssesContext) -> torch.Tensor:
        o_TnH = self.inner(seq_to_heads(q_LNH, ctx.comm, ctx.sizes), k, v, ctx.meta)
        return heads_to_seq(o_TnH, ctx.comm, ctx.sizes)
