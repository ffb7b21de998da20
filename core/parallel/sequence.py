"""Sequence parallelism over one packed forward (Ulysses or ring, chosen by the recipe).

The pipeline packs every token of a forward (all rows of all requests: the
prefix at prefill, ``<timestep>`` + image tokens at every step) into one
stream of T tokens with its ``Run`` list. ``SequenceParallelRunner`` gives
rank i of the sp axis the contiguous tokens ``[off_i, off_i + sizes[i])``
with ``sizes`` as even as T allows (T need not divide: the first ``T % u``
ranks get one token more), runs the backbone on them with a Ulysses or ring
attention context over the whole stream, and all-gathers the last hidden
states so the image head (replicated) sees every token.

Embeddings, the patch embedding and the final layer run replicated on every
sp rank: they are a few percent of the work and keep the model code unaware
of the split.
"""
from __future__ import annotations

import torch

from omni.build_options import BuildOptions
from omni.kv_pool import PoolContext
from omni.specs import AttentionSpec

from .ring import RingAttention, RingContext, resolve_lse_kernel
from .ulysses import UlyssesAttention, UlyssesContext, kv_heads_per_rank


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` tokens over ``parts`` ranks, contiguous, sizes differing by at most one."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def install_sp_kernels(attention: torch.nn.Module, style, *, mesh, platform, cfg, opts: BuildOptions) -> None:
    """Replace an attention module's kernels (dict mask -> kernel) by their Ulysses or ring wrappers."""
    tp = mesh.size("tp")
    n, k = getattr(cfg, style.heads) // tp, getattr(cfg, style.kv_heads) // tp
    head_dim = getattr(cfg, style.head_dim)
    masks = list(getattr(attention, style.kernels))
    if mesh.sp_kind == "ulysses":
        u = mesh.size("ulysses")
        kv = kv_heads_per_rank(n, k, u)
        kernels = {m: UlyssesAttention(platform.attention(opts.attention_spec(n // u, kv, head_dim, m)))
                   for m in masks}
    else:
        # one unpaged dense kernel serves every mask: the ring builds a mask for each rotating K/V chunk
        inner = resolve_lse_kernel(platform, AttentionSpec(num_heads=n, num_kv_heads=k, head_dim=head_dim,
                                                           dtype=opts.dtype, mask="dense", return_lse=True,
                                                           backend=opts.attn_backend))
        kernels = {m: RingAttention(inner) for m in masks}
    setattr(attention, style.kernels, kernels)


class SequenceParallelRunner:
    """Runs ``model.backbone`` on this rank's chunk of a packed forward; returns every token's hidden state."""

    def __init__(self, mesh):
        self.comm, self.kind = mesh.comm("sp"), mesh.sp_kind

    def __call__(self, model, x_TD, cos_TH, sin_TH, *, pool, runs, mask: str, paged: bool, device) -> torch.Tensor:
        sizes = split_sizes(x_TD.shape[0], self.comm.size)
        lo = sum(sizes[: self.comm.rank])
        mine = slice(lo, lo + sizes[self.comm.rank])
        if self.kind == "ulysses":
            ctx = UlyssesContext(PoolContext(pool, runs, mask=mask, paged=paged, device=device), self.comm, sizes)
        else:
            ctx = RingContext(pool, runs, mask, self.comm, sizes, device)
        h_LD = model.backbone(x_TD[mine], cos_TH[mine], sin_TH[mine], ctx)
        return self.comm.all_gather_rows(h_LD, sizes)
