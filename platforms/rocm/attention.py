"""Attention kernels of the ROCm platform and the rule that picks one per spec.

May assume: the spec is resolved on a worker whose device is set; tensors
passed to the returned objects live on that device. aiter is imported here
lazily, at resolution, never at package import.

Backends, in ``auto`` order for masks ``none`` / ``causal``:

    aiter   ``aiter.flash_attn_func`` (BSND, when every run of the batch has the
            same query and key lengths) or ``aiter.flash_attn_varlen_func``
            (TND, int32 ``cu_seqlens`` with a leading 0): gfx942 / gfx950,
            fp16/bf16, head_dim % 8 == 0 and <= 256. ``window_size`` is aiter's
            3-tuple ``(left, right, sink)``; causal is bottom-right aligned.
            Paged KV is not wired: the CK kernels' page-size limits for
            ``block_table`` are unverified here.
    sdpa    ``F.scaled_dot_product_attention`` (AOTriton flash / efficient on
            ROCm) through the device-generic packed-SDPA object
            (``omni.platforms.common.sdpa``): equal-length batches in one call,
            pages gathered on the device.

``dense`` masks go to sdpa. A named backend that cannot serve a spec is
refused with its reason; the chain is only walked for ``auto``.
"""
from __future__ import annotations

import torch

from omni.platforms.common.attention import first_fit, lengths, softmax_scale
from omni.platforms.common.sdpa import SdpaAttention
from omni.specs import AttentionSpec, VarlenMeta

from .capabilities import AITER_ARCHS, RocmCaps, load_aiter

HALF = (torch.float16, torch.bfloat16)
NO_WINDOW = (-1, -1, 0)  # aiter: (left, right, sink tokens); -1 = unbounded


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out  # (out, lse) when lse is asked for


class AiterAttention:
    name = "rocm-aiter"

    def __init__(self, spec: AttentionSpec, aiter):
        self.aiter = aiter
        self.kw = {"softmax_scale": softmax_scale(spec), "causal": spec.mask == "causal", "window_size": NO_WINDOW}

    def __call__(self, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        lq, lk = lengths(meta.cu_seqlens_q_host), lengths(meta.cu_seqlens_k_host)
        if len(set(lq)) == 1 and len(set(lk)) == 1 and sum(lq) == q_TNH.shape[0]:
            return self._batched(q_TNH, k, v, len(lq), lq[0], lk[0])
        return _first(self.aiter.flash_attn_varlen_func(
            q_TNH, k, v, meta.cu_seqlens_q_B1, meta.cu_seqlens_k_B1, meta.max_seqlen_q, meta.max_seqlen_k,
            dropout_p=0.0, **self.kw))

    def _batched(self, q, k, v, b: int, lq: int, lk: int) -> torch.Tensor:
        qb = q.reshape(b, lq, *q.shape[1:])
        kb, vb = (t[: b * lk].reshape(b, lk, *t.shape[1:]) for t in (k, v))
        return _first(self.aiter.flash_attn_func(qb, kb, vb, dropout_p=0.0, **self.kw)).reshape(q.shape)


def build_aiter(spec: AttentionSpec, caps: RocmCaps, reject, load=load_aiter):
    if not caps.aiter_installed:
        return reject("aiter: not installed (package amd-aiter, shipped in ROCm containers)")
    if caps.arch not in AITER_ARCHS:
        return reject(f"aiter: flash attention is enabled on gfx942/gfx950 (MI300/MI325/MI350/MI355), "
                      f"this device is {caps.arch or 'unknown'}")
    if spec.mask == "dense":
        return reject("aiter: no arbitrary (dense) masks; sdpa serves them")
    if spec.paged:
        return reject("aiter: paged KV is not wired (CK block_table page-size limits unverified); sdpa gathers pages")
    if spec.dtype not in HALF or spec.head_dim % 8 or spec.head_dim > 256:
        return reject(f"aiter: needs fp16/bf16 and head_dim % 8 == 0, <= 256; got {spec.dtype} / {spec.head_dim}")
    aiter = load()
    if isinstance(aiter, str):
        return reject(aiter)
    return AiterAttention(spec, aiter)


def build_sdpa(spec: AttentionSpec, caps: RocmCaps, reject):
    return SdpaAttention(spec, "rocm-sdpa")


BUILDERS = {"aiter": build_aiter, "sdpa": build_sdpa}


def resolve(spec: AttentionSpec, caps: RocmCaps, reject, builders=BUILDERS):
    """First backend that fits; a named ``spec.backend`` is the only one tried."""
    auto = ("sdpa",) if spec.mask == "dense" else ("aiter", "sdpa")
    return first_fit("rocm", spec, caps, reject, builders, auto)
