"""Ring attention: K/V chunks rotate around the sequence-parallel ranks; partial results merge by LSE.

Each of the ``u`` ranks holds a contiguous chunk of the packed token stream
(uneven allowed) with all of its (tp-local) heads. Its queries attend to:

- *stale* keys: positions of their rows that this forward does not write
  (the prefix, written by earlier forwards). Every ring rank's pool holds
  them, because every rank writes every chunk it sees (below).
- *fresh* keys: the K/V of this forward's written tokens, which arrive chunk
  by chunk: ``u`` steps, each computing against the chunk in hand while the
  next one is sent on (``isend``/``irecv``) and writing it to the local pool.

Visibility is the pool semantics of ``PoolContext`` written per token: a
query of row r at position p sees a key of row r at position j iff
``j < lim`` where ``lim = k_end`` (mask none) or ``p + 1 + k_end - q_end``
(causal, bottom-right aligned). Each partial attention is one dense-masked
call of a kernel that returns the log-sum-exp (``AttentionSpec.return_lse``);
``merge`` combines them exactly (a query that sees nothing contributes 0).

Shape suffixes: T all tokens, L my tokens, C a chunk, S stale keys, N/K
heads, H head dim.
"""
from __future__ import annotations

import torch

from omni.attention_context import dense_meta
from omni.kv_pool import store_kv

from .mesh import MeshError


def resolve_lse_kernel(platform, spec):
    """The platform's attention for ``spec`` (``return_lse=True``), refused clearly if it lacks the LSE."""
    impl = platform.attention(spec)
    if not getattr(impl, "returns_lse", False):
        raise MeshError(f"ring attention needs an attention kernel that returns the log-sum-exp, but platform "
                        f"{platform.name!r} answered {spec} with {getattr(impl, 'name', impl)!r}, which does not "
                        "declare returns_lse; use parallel.ulysses instead, or a platform that implements "
                        "AttentionSpec.return_lse (the reference does)")
    return impl


def merge(o_TNH, lse_TN, o2_TNH, lse2_TN):
    """Combine two partial attentions over disjoint key sets (fp32 accumulation)."""
    if o_TNH is None:
        return o2_TNH.float(), lse2_TN
    lse = torch.logaddexp(lse_TN, lse2_TN)
    w1 = torch.exp(lse_TN - lse).nan_to_num(0.0)[..., None]
    w2 = torch.exp(lse2_TN - lse).nan_to_num(0.0)[..., None]
    return o_TNH * w1 + o2_TNH.float() * w2, lse


class RingContext:
    """Per-forward bookkeeping: every token's row, position, visibility limit and pool slot."""

    def __init__(self, pool, runs, mask: str, comm, sizes: list[int], device):
        self.pool, self.comm, self.sizes, self.mask = pool, comm, sizes, mask
        rows: dict[tuple, int] = {}
        row, pos, lim, slot, written = [], [], [], [], {}
        for run in runs:
            r = rows.setdefault(run.pages, len(rows))
            p = torch.arange(run.q_start, run.q_end)
            row.append(torch.full_like(p, r if run.write else -1))  # unwritten tokens are not keys
            pos.append(p)
            lim.append(torch.full_like(p, run.k_end) if mask == "none" else p + 1 + (run.k_end - run.q_end))
            s = pool.slots(list(run.pages), run.q_start, run.q_end) if run.write else torch.full_like(p, -1)
            slot.append(s)
            if run.write:
                written.setdefault(r, set()).update(range(run.q_start, run.q_end))
        self.row_T, self.pos_T, self.lim_T, self.slot_T = (torch.cat(x).to(device) for x in (row, pos, lim, slot))
        self.qrow_T = torch.tensor([rows[r.pages] for r in runs for _ in range(r.q_len)], device=device)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self._stale(runs, rows, written, device)
        self.layer = 0

    def _stale(self, runs, rows: dict, written: dict, device) -> None:
        """Keys of this forward's rows that earlier forwards wrote (read from the local pool)."""
        k_end = {}
        for run in runs:
            k_end[run.pages] = max(k_end.get(run.pages, 0), run.k_end)
        slots, row, pos = [], [], []
        for pages, end in k_end.items():
            r = rows[pages]
            keep = [j for j in range(end) if j not in written.get(r, ())]
            if keep:
                all_slots = self.pool.slots(list(pages), 0, end)
                slots.append(all_slots[keep])
                row.append(torch.full((len(keep),), r))
                pos.append(torch.tensor(keep))
        empty = torch.zeros(0, dtype=torch.long)
        self.stale_slots, self.stale_row, self.stale_pos = (
            (torch.cat(x) if x else empty).to(device) for x in (slots, row, pos))

    def chunk(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    def write(self, chunk: int, k_CKH: torch.Tensor, v_CKH: torch.Tensor) -> None:
        """Store chunk ``chunk``'s written tokens in this rank's pool (layer ``self.layer``)."""
        slots = self.slot_T[self.chunk(chunk)]
        keep = slots >= 0
        if not bool(keep.any()):
            return
        store_kv(*self.pool.flat(self.layer), k_CKH[keep], v_CKH[keep], slots[keep])

    def stale_keys(self):
        k_pool, v_pool = self.pool.flat(self.layer)
        return k_pool[self.stale_slots], v_pool[self.stale_slots]

    def mask_for(self, krow_C: torch.Tensor, kpos_C: torch.Tensor) -> torch.Tensor:
        """``[L, C]`` True where my queries see those keys."""
        mine = self.chunk(self.comm.rank)
        qrow, lim = self.qrow_T[mine], self.lim_T[mine]
        return (qrow[:, None] == krow_C[None, :]) & (kpos_C[None, :] < lim[:, None])

    def keys_values(self, layer: int, k_LKH: torch.Tensor, v_LKH: torch.Tensor):
        self.layer = layer
        self.write(self.comm.rank, k_LKH, v_LKH)
        return k_LKH, v_LKH, self  # the ring kernel does the rest


class RingAttention:
    """Kernel wrapper: partial attention per K/V chunk while the chunks rotate; LSE merge."""

    def __init__(self, inner):
        self.inner, self.name = inner, f"ring[{inner.name}]"

    def __call__(self, q_LNH: torch.Tensor, k_LKH, v_LKH, ctx: RingContext) -> torch.Tensor:
        u, me = ctx.comm.size, ctx.comm.rank
        o = lse = None
        if ctx.stale_slots.numel() and q_LNH.shape[0]:
            k_S, v_S = ctx.stale_keys()
            o, lse = merge(o, lse, *self._partial(q_LNH, k_S, v_S, ctx.mask_for(ctx.stale_row, ctx.stale_pos)))
        kv = torch.cat([k_LKH, v_LKH], dim=1)
        K = k_LKH.shape[1]
        for step in range(u):
            src = (me - step) % u
            wait = None
            if step < u - 1:
                _, wait = ctx.comm.shift(kv, ctx.sizes[(src - 1) % u])
            if q_LNH.shape[0] and kv.shape[0]:
                c = ctx.chunk(src)
                mask = ctx.mask_for(ctx.row_T[c], ctx.pos_T[c])
                o, lse = merge(o, lse, *self._partial(q_LNH, kv[:, :K], kv[:, K:], mask))
            if wait is not None:
                kv = wait()
                ctx.write((src - 1) % u, kv[:, :K], kv[:, K:])
        if o is None:
            return torch.zeros_like(q_LNH)
        return o.to(q_LNH.dtype)

    def _partial(self, q_LNH, k_CKH, v_CKH, mask_LC):
        return self.inner(q_LNH, k_CKH, v_CKH, dense_meta(mask_LC))
