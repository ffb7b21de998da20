"""Recording doubles of ``torch_musa`` (the ``torch.musa`` device state) and Moore Threads'
FlashAttention build (module ``flash_attn_interface``, the FA3 interface).

Contract of ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k,
max_seqlen_q, max_seqlen_k, ..., softmax_scale=None, causal=False, ...,
window_size=(-1, -1), ...)`` (platform_apis.md 1.2 FA3, 1.6): TND, int32
device ``cu_seqlens`` with B+1 entries starting at 0, fp16/bf16, GQA by fewer
kv heads, bottom-right causal; this double returns ``(out, lse)`` like older
FA3 builds, so callers must unwrap. No paged KV (``seqused_k``/``page_table``).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .device import FakeDevice, vendor_module
from .recording import Recorder, cuda_offsets, reference_attention, require

HALF = (torch.float16, torch.bfloat16)


class MusaFlashDouble:
    def __init__(self):
        self.recorder = Recorder()

    def module(self):
        return vendor_module("flash_attn_interface", flash_attn_varlen_func=self.flash_attn_varlen_func)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
        call = self.recorder.record("flash_attn_varlen_func", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                    softmax_scale=softmax_scale, causal=causal)
        require(q.dim() == 3 and k.dim() == 3,
                f"flash_attn_varlen_func: TND q/k/v, got {tuple(q.shape)} / {tuple(k.shape)}")
        require(q.dtype in HALF and k.dtype == q.dtype, f"flash_attn_varlen_func (MUSA): fp16/bf16, got {q.dtype}")
        require(q.shape[1] % k.shape[1] == 0, "flash_attn_varlen_func: query heads a multiple of kv heads")
        require(seqused_k is None and seqused_q is None and window_size == (-1, -1) and softcap == 0.0,
                "MUSA flash double: no paged KV, window or softcap")
        cu_q = cuda_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        cu_k = cuda_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        for name, cu, given in (("max_seqlen_q", cu_q, max_seqlen_q), ("max_seqlen_k", cu_k, max_seqlen_k)):
            require(type(given) is int and given >= max(b - a for a, b in zip(cu, cu[1:])),
                    f"{name}={given!r} too small")
        call.notes.update(layout="TND", cu_seqlens="B+1 with leading 0")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out = reference_attention(q, k, v, cu_q, cu_k, causal=causal, scale=scale)
        return out, torch.zeros(q.shape[1], q.shape[0])


class MusaDoubles:
    def __init__(self, device: FakeDevice, flash: MusaFlashDouble | None):
        self.device, self.flash = device, flash


def install_musa(monkeypatch, *, capability=(3, 1), count: int = 8, flash: bool = True, graphs: bool = True,
                 mccl: bool = True, name: str = "MTT S5000") -> MusaDoubles:
    """torch_musa importable, ``torch.musa`` with ``count`` devices; the vendor flash build and MCCL optional."""
    device = FakeDevice(count=count, name=name, capability=capability, graph_class="MUSAGraph" if graphs else None)
    device_module = device.as_module("torch.musa")
    monkeypatch.setattr(torch, "musa", device_module, raising=False)
    monkeypatch.setitem(sys.modules, "torch_musa", vendor_module("torch_musa"))
    double = MusaFlashDouble() if flash else None
    monkeypatch.setitem(sys.modules, "flash_attn_interface", double.module() if double else None)
    real = dist.is_backend_available
    monkeypatch.setattr(dist, "is_backend_available", lambda backend: mccl if backend == "mccl" else real(backend))
    return MusaDoubles(device, double)
