"""Packed (varlen) attention through ``F.scaled_dot_product_attention``: every device's fallback.

May assume: ``torch`` only. Tensors passed to the object live on one device,
whichever it is; the device's own SDPA kernels (cuDNN / flash / efficient on
CUDA, AOTriton on ROCm, aclnnFlashAttentionScore on Ascend, oneDNN on XPU,
torch_musa's on MUSA) are chosen by torch. Equal-length batches go in one
call, others one call per sequence; paged pools are gathered on the device
with a length mask. Only host lengths are read, so the object is capturable.

Shape suffixes as in ``omni.specs``: T queries, S keys, N heads, K kv heads,
H head dim, B sequences, L per-sequence length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omni.reference import causal_mask
from omni.specs import AttentionSpec, VarlenMeta

from .attention import lengths, softmax_scale


class SdpaAttention:
    """``F.scaled_dot_product_attention`` over packed runs; ``name`` (e.g. ``"npu-sdpa"``) says who answered."""

    def __init__(self, spec: AttentionSpec, name: str):
        self.spec, self.name, self.scale = spec, name, softmax_scale(spec)
        self.rep = spec.num_heads // spec.num_kv_heads

    def __call__(self, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        if self.spec.mask == "dense":
            return self._sdpa(q_TNH[None], k[None], v[None], meta.mask_TS)[0]
        if self.spec.paged:
            return self._paged(q_TNH, k, v, meta)
        return self._packed(q_TNH, k, v, meta)

    def _sdpa(self, q_BLNH, k_BSKH, v_BSKH, mask=None, is_causal=False) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BSKH, v_BSKH))
        gqa = {}
        if self.rep > 1 and mask is None:
            gqa = {"enable_gqa": True}
        elif self.rep > 1:  # the masked (efficient) kernel has no GQA: expand kv heads
            k, v = k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, **gqa)
        return o.transpose(1, 2)

    def _causal(self, lq: int, lk: int, device) -> dict:
        if self.spec.mask != "causal":
            return {}
        return {"is_causal": True} if lq == lk else {"mask": causal_mask(lq, lk, device)}

    def _packed(self, q, k, v, meta: VarlenMeta) -> torch.Tensor:
        cq, ck = meta.cu_seqlens_q_host, meta.cu_seqlens_k_host
        lq, lk = lengths(cq), lengths(ck)
        if len(set(lq)) == 1 and len(set(lk)) == 1:  # one batched call
            b = len(lq)
            qb, kb, vb = (t[: c[-1]].reshape(b, n, *t.shape[1:]) for t, c, n in
                          ((q, cq, lq[0]), (k, ck, lk[0]), (v, ck, lk[0])))
            return self._sdpa(qb, kb, vb, **self._causal(lq[0], lk[0], q.device)).reshape(q.shape)
        out = torch.zeros_like(q)
        for b in range(len(lq)):
            qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            out[qs] = self._sdpa(q[None, qs], k[None, ks], v[None, ks], **self._causal(lq[b], lk[b], q.device))[0]
        return out

    def _paged_mask(self, lq: int, s: int, used: torch.Tensor) -> torch.Tensor:
        """Keep key j < used (and bottom-right causal); ``used`` 0-d or ``[B, 1, 1]`` on the device."""
        j = torch.arange(s, device=used.device)[None]
        keep = j < used
        if self.spec.mask == "causal":
            i = torch.arange(lq, device=used.device)[:, None]
            keep = keep & (j <= i + used - lq)
        return keep

    def _paged(self, q, k_pool, v_pool, meta: VarlenMeta) -> torch.Tensor:
        table = meta.block_table_BP.long().clamp(0, k_pool.shape[0] - 1)
        used = meta.seqused_k_B.long()
        s = table.shape[1] * k_pool.shape[1]
        cq = meta.cu_seqlens_q_host
        lq = lengths(cq)
        if len(set(lq)) == 1:  # one batched call over gathered pages
            kb, vb = k_pool[table].flatten(1, 2), v_pool[table].flatten(1, 2)
            mask = self._paged_mask(lq[0], s, used[:, None, None])[:, None]
            out = self._sdpa(q[: cq[-1]].reshape(len(lq), lq[0], *q.shape[1:]), kb, vb, mask)
            return out.reshape(-1, *q.shape[1:])
        out = torch.zeros_like(q)
        for b in range(len(lq)):
            kb, vb = k_pool[table[b]].flatten(0, 1), v_pool[table[b]].flatten(0, 1)
            qs = slice(cq[b], cq[b + 1])
            out[qs] = self._sdpa(q[None, qs], kb[None], vb[None], self._paged_mask(lq[b], s, used[b]))[0]
        return out
