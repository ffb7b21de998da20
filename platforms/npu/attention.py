"""Attention kernels of the NPU platform and the rule that picks one per spec.

May assume: the spec is resolved on a worker whose NPU is set and torch_npu
is imported (detection did it); tensors passed to the returned objects live
on that NPU.

Backends, in ``auto`` order for masks ``none`` / ``causal``:

    fia     ``torch_npu.npu_fused_infer_attention_score`` in ``TND`` layout
            (Atlas A2/A3/950; graph-capturable). Ascend conventions, all
            different from CUDA's:
            - lengths are HOST ``list[int]``s of cumulative ENDS without the
              leading 0 (lengths 2,2,2 -> ``[2, 4, 6]``) in
              ``actual_seq_lengths`` / ``actual_seq_lengths_kv``; with paged
              KV, ``actual_seq_lengths_kv`` holds each sequence's key count
              (not cumulative), as vllm-ascend passes it;
            - mask polarity is inverted: True = masked out. Causal is
              ``sparse_mode=3`` (rightDownCausal = bottom-right aligned) with
              the compressed 2048x2048 ``triu(ones, diagonal=1)`` mask;
              full attention is ``atten_mask=None, sparse_mode=0``;
            - ``scale`` defaults to 1.0 and ``num_heads`` to 1: both passed;
            - paged KV: pools ``[P, G, K, H]`` viewed as ``[P, G, K*H]``
              (BnBsH), ``block_table`` int32 ``[B, pages]``, ``block_size``.
            Limits: fp16/bf16; head_dim 128 or 192 (64 without GQA) in TND;
            N <= 256, N/K <= 64; paged page_size a multiple of 128 in 128..512.
    sdpa    ``F.scaled_dot_product_attention`` (routed by torch_npu to
            aclnnFlashAttentionScore, which takes SDPA's True = attend) through
            the device-generic packed-SDPA object (``omni.platforms.common.sdpa``);
            not for paged KV: gathered pages need a ``[B,1,1,S]`` key-padding
            mask, which that kernel rejects (error 161001).

``dense`` masks go to sdpa.
"""
from __future__ import annotations

import torch

from omni.platforms.common.attention import first_fit, lengths, softmax_scale
from omni.platforms.common.sdpa import SdpaAttention
from omni.specs import AttentionSpec, VarlenMeta

from .capabilities import NpuCaps, load_torch_npu

HALF = (torch.float16, torch.bfloat16)
CAUSAL_MASK_SIDE = 2048  # sparse modes 2/3/4 take this compressed mask
FULL, RIGHT_DOWN_CAUSAL = 0, 3  # sparse_mode values
MAX_BATCH = 4096  # TND: at most this many sequences per call


def causal_mask_2048(device) -> torch.Tensor:
    """Ascend's compressed causal mask: True = masked out (upper triangle)."""
    ones = torch.ones(CAUSAL_MASK_SIDE, CAUSAL_MASK_SIDE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


class FiaAttention:
    name = "npu-fia"

    def __init__(self, spec: AttentionSpec, torch_npu):
        self.op, self.spec = torch_npu.npu_fused_infer_attention_score, spec
        self.kw = {"num_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "input_layout": "TND",
                   "scale": softmax_scale(spec),
                   "sparse_mode": RIGHT_DOWN_CAUSAL if spec.mask == "causal" else FULL}
        if spec.paged:
            self.kw["block_size"] = spec.page_size
        self._masks: dict[torch.device, torch.Tensor] = {}  # built on the first (warm-up) call per device

    def __call__(self, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        if meta.num_seqs > MAX_BATCH:
            raise ValueError(f"npu-fia: {meta.num_seqs} sequences in one call; TND takes at most {MAX_BATCH}")
        q_ends = list(meta.cu_seqlens_q_host[1:])  # cumulative ends, no leading 0
        if self.spec.paged:
            kv = {"actual_seq_lengths_kv": lengths(meta.cu_seqlens_k_host), "block_table": meta.block_table_BP}
            k, v = k.flatten(2), v.flatten(2)  # [P, G, K, H] -> BnBsH [P, G, K*H], a free view
        else:
            kv = {"actual_seq_lengths_kv": list(meta.cu_seqlens_k_host[1:])}
        out, _lse = self.op(q_TNH, k, v, atten_mask=self._mask(q_TNH.device), actual_seq_lengths=q_ends, **kv,
                            **self.kw)
        return out

    def _mask(self, device) -> torch.Tensor | None:
        if self.spec.mask != "causal":
            return None
        if device not in self._masks:
            self._masks[device] = causal_mask_2048(device)
        return self._masks[device]


def _tnd_head_dim_ok(spec: AttentionSpec) -> bool:
    return spec.head_dim in (128, 192) or (spec.head_dim == 64 and spec.num_heads == spec.num_kv_heads)


def build_fia(spec: AttentionSpec, caps: NpuCaps, reject, load=load_torch_npu):
    if not caps.fia:
        return reject("fia: runs on Atlas A2/A3 (Ascend910B, Ascend910_93) and Ascend 950; "
                      f"this SoC is {caps.soc or 'unknown'}")
    if spec.mask == "dense":
        return reject("fia: no arbitrary (dense) masks in TND layout here; sdpa serves them")
    if spec.dtype not in HALF:
        return reject(f"fia: query must be fp16/bf16, got {spec.dtype}")
    if spec.head_dim % 16 or not _tnd_head_dim_ok(spec):
        return reject(f"fia: TND layout needs head_dim a multiple of 16 among 128/192 (64 without GQA); "
                      f"got {spec.head_dim} with {spec.num_heads}/{spec.num_kv_heads} heads")
    if spec.num_heads > 256 or spec.num_heads // spec.num_kv_heads > 64:
        return reject(f"fia: needs num_heads <= 256 and a GQA ratio <= 64, got {spec.num_heads}/{spec.num_kv_heads}")
    if spec.paged and (spec.page_size % 128 or not 128 <= spec.page_size <= 512):
        return reject(f"fia: paged KV needs page_size a multiple of 128 in 128..512, got {spec.page_size}")
    torch_npu = load()
    if isinstance(torch_npu, str):
        return reject(torch_npu)
    return FiaAttention(spec, torch_npu)


def build_sdpa(spec: AttentionSpec, caps: NpuCaps, reject):
    if spec.paged:
        return reject("sdpa: gathered pages need a [B,1,1,S] key-padding mask, which aclnnFlashAttentionScore "
                      "rejects (error 161001); paged KV runs on fia (page_size a multiple of 128)")
    return SdpaAttention(spec, "npu-sdpa")


BUILDERS = {"fia": build_fia, "sdpa": build_sdpa}


def resolve(spec: AttentionSpec, caps: NpuCaps, reject, builders=BUILDERS):
    """First backend that fits; a named ``spec.backend`` is the only one tried."""
    auto = ("sdpa",) if spec.mask == "dense" else ("fia", "sdpa")
    return first_fit("npu", spec, caps, reject, builders, auto)
