"""Attention kernels of the XPU platform and the rule that picks one per spec.

May assume: the spec is resolved on a worker whose XPU is set; tensors passed
to the returned objects live on it. IPEX is imported lazily, at resolution.

Backends, in ``auto`` order:

    varlen  IPEX ``ipex.llm.functional.varlen_attention`` (TND; ``seqlen_q`` /
            ``seqlen_k`` are the CUDA-style int32 device offsets, B+1 entries
            with a leading 0; writes into a preallocated ``out``), for full
            (``none``) attention, unpaged, fp16/bf16, head_dim <= 256. Equal
            head counts are passed (GQA kv heads are expanded first). Causal is
            left to sdpa: how IPEX aligns ``is_causal`` when query and key runs
            differ in length is not documented.
    sdpa    ``F.scaled_dot_product_attention`` (oneDNN / flash kernels on XPU)
            through the device-generic packed-SDPA object
            (``omni.platforms.common.sdpa``): every mask, pages gathered on the device.
"""
from __future__ import annotations

import torch

from omni.platforms.common.attention import first_fit, softmax_scale
from omni.platforms.common.sdpa import SdpaAttention
from omni.specs import AttentionSpec, VarlenMeta

from .capabilities import XpuCaps, load_ipex

HALF = (torch.float16, torch.bfloat16)


class IpexVarlenAttention:
    name = "xpu-ipex-varlen"

    def __init__(self, spec: AttentionSpec, ipex):
        self.fn = ipex.llm.functional.varlen_attention
        self.rep = spec.num_heads // spec.num_kv_heads
        self.scale = softmax_scale(spec)

    def __call__(self, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        if self.rep > 1:  # IPEX varlen takes as many kv heads as query heads
            k, v = k.repeat_interleave(self.rep, dim=1), v.repeat_interleave(self.rep, dim=1)
        out = torch.empty_like(q_TNH)
        self.fn(q_TNH, k, v, out, seqlen_q=meta.cu_seqlens_q_B1, seqlen_k=meta.cu_seqlens_k_B1, alibi_slopes=None,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, pdropout=0.0,
                softmax_scale=self.scale, zero_tensors=False, is_causal=False, return_softmax=False, gen_=None)
        return out


def build_varlen(spec: AttentionSpec, caps: XpuCaps, reject, load=load_ipex):
    if caps.ipex:
        return reject(f"varlen: {caps.ipex}")
    if spec.mask != "none":
        return reject(f"varlen: IPEX varlen serves full attention only here (mask {spec.mask!r}: sdpa)")
    if spec.paged:
        return reject("varlen: IPEX varlen_attention takes no block table; sdpa gathers pages")
    if spec.dtype not in HALF or spec.head_dim > 256:
        return reject(f"varlen: needs fp16/bf16 and head_dim <= 256, got {spec.dtype} / {spec.head_dim}")
    ipex = load()
    if isinstance(ipex, str):
        return reject(ipex)
    return IpexVarlenAttention(spec, ipex)


def build_sdpa(spec: AttentionSpec, caps: XpuCaps, reject):
    return SdpaAttention(spec, "xpu-sdpa")


BUILDERS = {"varlen": build_varlen, "sdpa": build_sdpa}


def resolve(spec: AttentionSpec, caps: XpuCaps, reject, builders=BUILDERS):
    """First backend that fits; a named ``spec.backend`` is the only one tried."""
    auto = ("varlen", "sdpa")  # every mask: varlen refuses all but full attention
    return first_fit("xpu", spec, caps, reject, builders, auto)
