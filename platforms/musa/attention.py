"""Attention kernels of the MUSA platform and the rule that picks one per spec.

May assume: the spec is resolved on a worker whose MUSA device is set;
tensors passed to the returned objects live on it.

Backends, in ``auto`` order for masks ``none`` / ``causal``:

    fa3     Moore Threads' FlashAttention build, module ``flash_attn_interface``
            (the FA3 interface: ``flash_attn_varlen_func`` over TND with int32
            ``cu_seqlens`` with a leading 0, bottom-right causal; older builds
            return ``(out, lse)``): compute capability >= 3.1 (S5000-class),
            fp16/bf16, head_dim % 8 == 0 and <= 128. No paged KV.
    sdpa    torch_musa's ``F.scaled_dot_product_attention`` (its flash mode on
            MUSA arch > 2.1 for fp16/bf16, head_dim <= 128; math otherwise)
            through the device-generic packed-SDPA object
            (``omni.platforms.common.sdpa``): every mask, pages gathered on the device.
"""
from __future__ import annotations

import torch

from omni.platforms.common.attention import first_fit, softmax_scale
from omni.platforms.common.sdpa import SdpaAttention
from omni.specs import AttentionSpec, VarlenMeta

from .capabilities import FLASH_MIN_CC, FLASH_MODULE, MusaCaps, load_module

HALF = (torch.float16, torch.bfloat16)


class MusaFlashAttention:
    name = "musa-flash"

    def __init__(self, spec: AttentionSpec, module):
        self.fn = module.flash_attn_varlen_func
        self.kw = {"softmax_scale": softmax_scale(spec), "causal": spec.mask == "causal"}

    def __call__(self, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        out = self.fn(q_TNH, k, v, meta.cu_seqlens_q_B1, meta.cu_seqlens_k_B1, meta.max_seqlen_q,
                      meta.max_seqlen_k, **self.kw)
        return out[0] if isinstance(out, tuple) else out  # older FA3 builds return (out, lse)


def build_flash(spec: AttentionSpec, caps: MusaCaps, reject, load=load_module):
    if not caps.flash_installed:
        return reject(f"fa3: the vendor FlashAttention ({FLASH_MODULE}) is not installed")
    if caps.cc < FLASH_MIN_CC:
        return reject("fa3: the vendor flash kernels need compute capability >= 3.1, "
                      f"device is {caps.cc[0]}.{caps.cc[1]}")
    if spec.paged:
        return reject("fa3: paged KV unsupported by the vendor flash attention; sdpa gathers pages")
    if spec.mask == "dense":
        return reject("fa3: no arbitrary (dense) masks; sdpa serves them")
    if spec.dtype not in HALF or spec.head_dim % 8 or spec.head_dim > 128:
        return reject(f"fa3: needs fp16/bf16 and head_dim % 8 == 0, <= 128; got {spec.dtype} / {spec.head_dim}")
    module = load(FLASH_MODULE, "fa3")
    if isinstance(module, str):
        return reject(module)
    return MusaFlashAttention(spec, module)


def build_sdpa(spec: AttentionSpec, caps: MusaCaps, reject):
    return SdpaAttention(spec, "musa-sdpa")


BUILDERS = {"fa3": build_flash, "sdpa": build_sdpa}


def resolve(spec: AttentionSpec, caps: MusaCaps, reject, builders=BUILDERS):
    """First backend that fits; a named ``spec.backend`` is the only one tried."""
    auto = ("sdpa",) if spec.mask == "dense" else ("fa3", "sdpa")
    return first_fit("musa", spec, caps, reject, builders, auto)
