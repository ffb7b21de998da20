"""How one forward's attention sees its keys: the seam between model and KV cache.

Model attention layers call ``ctx.keys_values(layer, k_TKH, v_TKH)`` with the
keys and values of the tokens in this forward; the context stores them where
its cache wants them and returns what the attention kernel should read, plus
the ``VarlenMeta``. ``ctx.mask`` names which resolved kernel to use
("none", "causal" or "dense"). The model never knows whether a cache exists.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .specs import VarlenMeta


@dataclass
class DenseContext:
    """No cache: one packed forward over whole sequences with an explicit bool mask.

    This is the official full-sequence path (the generalized causal mask over
    text and image), kept as the parity oracle of the prefix-KV engine path.
    """

    meta: VarlenMeta
    mask: str = "dense"

    def keys_values(self, layer: int, k_TKH: torch.Tensor, v_TKH: torch.Tensor):
        return k_TKH, v_TKH, self.meta


def dense_meta(mask_TS: torch.Tensor) -> VarlenMeta:
    """Metadata for one dense-mask call over all packed tokens."""
    t, s = mask_TS.shape
    cu_q = torch.tensor([0, t], dtype=torch.int32, device=mask_TS.device)
    cu_k = torch.tensor([0, s], dtype=torch.int32, device=mask_TS.device)
    return VarlenMeta(cu_seqlens_q_B1=cu_q, cu_seqlens_k_B1=cu_k, max_seqlen_q=t, max_seqlen_k=s,
                      cu_seqlens_q_host=(0, t), cu_seqlens_k_host=(0, s), mask_TS=mask_TS)
