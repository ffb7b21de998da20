"""A recording double of ``aiter`` (AMD) and the ROCm device state a platform detects.

Contract (platform_apis.md 1.3): ``flash_attn_func`` takes BSND q/k/v;
``flash_attn_varlen_func`` takes TND q/k/v with int32 device ``cu_seqlens``
of B+1 entries starting at 0, and ``max_seqlen_*`` at least the longest run;
``window_size`` is aiter's 3-TUPLE ``(left, right, sink)`` (FA2's 2-tuple is
a different contract); fp16/bf16; GQA by fewer kv heads; causal is
bottom-right aligned. Only what the ROCm platform uses is emulated: no
window, no dropout, no bias/ALiBi, no paged ``block_table``.
"""
from __future__ import annotations

import sys

import torch

from .device import FakeDevice, vendor_module
from .recording import Recorder, cuda_offsets, cumulative, reference_attention, require
from .scaled_mm import install_scaled_mm

HALF = (torch.float16, torch.bfloat16)


def _check_common(q, k, v, dropout_p, window_size, heads_dim: int) -> None:
    require(isinstance(window_size, tuple) and len(window_size) == 3 and all(type(x) is int for x in window_size),
            f"aiter: window_size is a 3-tuple (left, right, sink); got {window_size!r} (FA2's 2-tuple is not aiter's)")
    require(window_size == (-1, -1, 0),
            f"aiter double: only the unbounded window (-1, -1, 0) is emulated, got {window_size}")
    require(dropout_p == 0.0, "aiter: inference passes dropout_p=0.0")
    require(q.dtype in HALF and k.dtype == q.dtype and v.dtype == q.dtype, f"aiter: fp16/bf16 q/k/v, got {q.dtype}")
    n, kh, h = q.shape[heads_dim], k.shape[heads_dim], q.shape[-1]
    require(h % 8 == 0 and h <= 256 and k.shape[-1] == h, f"aiter: head_dim % 8 == 0 and <= 256, got {h}")
    require(n % kh == 0, f"aiter: GQA needs query heads {n} to be a multiple of kv heads {kh}")


class AiterDouble:
    def __init__(self):
        self.recorder = Recorder()

    def module(self):
        return vendor_module("aiter", flash_attn_func=self.flash_attn_func,
                             flash_attn_varlen_func=self.flash_attn_varlen_func)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0,
                               dropout_p=0.0, softmax_scale=None, logits_soft_cap=0.0, causal=False,
                               window_size=(-1, -1, 0), bias=None, alibi_slopes=None, deterministic=False,
                               return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1, block_table=None,
                               out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None):
        call = self.recorder.record("flash_attn_varlen_func", q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q,
                                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                    softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                    block_table=block_table)
        require(q.dim() == 3 and k.dim() == 3, f"aiter varlen: TND q/k/v, got {tuple(q.shape)} / {tuple(k.shape)}")
        _check_common(q, k, v, dropout_p, window_size, heads_dim=1)
        require(block_table is None and bias is None and alibi_slopes is None and logits_soft_cap == 0.0,
                "aiter double: paged KV, bias, ALiBi and soft-cap are not emulated")
        cu_q = cuda_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        cu_k = cuda_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        require(len(cu_q) == len(cu_k), "aiter varlen: cu_seqlens_q and cu_seqlens_k describe different batch sizes")
        for name, cu, given in (("max_seqlen_q", cu_q, max_seqlen_q), ("max_seqlen_k", cu_k, max_seqlen_k)):
            longest = max(b - a for a, b in zip(cu, cu[1:]))
            require(type(given) is int and given >= longest,
                    f"aiter varlen: {name}={given!r} but the longest run is {longest}")
        call.notes.update(layout="TND", cu_seqlens="B+1 with leading 0", causal="bottom-right" if causal else "none")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return reference_attention(q, k, v, cu_q, cu_k, causal=causal, scale=scale)

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1, 0),
                        bias=None, alibi_slopes=None, deterministic=True, return_lse=False, return_attn_probs=False,
                        how_v3_bf16_cvt=1, cu_seqlens_q=None, cu_seqlens_kv=None, sink_ptr=None, num_splits=0):
        call = self.recorder.record("flash_attn_func", q=q, k=k, v=v, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size)
        require(q.dim() == 4 and k.dim() == 4 and q.shape[0] == k.shape[0],
                f"aiter flash_attn_func: BSND q/k/v with one batch size, got {tuple(q.shape)} / {tuple(k.shape)}")
        _check_common(q, k, v, dropout_p, window_size, heads_dim=2)
        require(bias is None and alibi_slopes is None and cu_seqlens_q is None,
                "aiter double: bias/ALiBi/cu_seqlens not emulated")
        call.notes.update(layout="BSND", causal="bottom-right" if causal else "none")
        b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out = reference_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cumulative([lq] * b),
                                  cumulative([lk] * b), causal=causal, scale=scale)
        return out.view(q.shape)


class RocmDoubles:
    def __init__(self, device: FakeDevice, aiter: AiterDouble | None, scaled_mm):
        self.device, self.aiter, self.scaled_mm = device, aiter, scaled_mm


ARCHS = {"gfx942": "AMD Instinct MI300X", "gfx950": "AMD Instinct MI355X", "gfx90a": "AMD Instinct MI250X"}


def install_rocm(monkeypatch, *, arch: str = "gfx942", count: int = 8, aiter: bool = True) -> RocmDoubles:
    """A ROCm torch (``torch.version.hip``) with ``count`` devices of ``arch``, aiter importable or not."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43484-9999")
    device = FakeDevice(count=count, name=ARCHS.get(arch, arch), arch=f"{arch}:sramecc+:xnack-",
                        graph_class="CUDAGraph")
    device.install(monkeypatch, torch.cuda)
    double = AiterDouble() if aiter else None
    if double:
        monkeypatch.setitem(sys.modules, "aiter", double.module())
    else:
        monkeypatch.setitem(sys.modules, "aiter", None)  # find_spec -> None: not installed
    fp8 = torch.float8_e4m3fnuz if arch == "gfx942" else torch.float8_e4m3fn
    return RocmDoubles(device, double, install_scaled_mm(monkeypatch, fp8, rowwise_out=(torch.bfloat16,)))
