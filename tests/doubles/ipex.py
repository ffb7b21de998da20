"""A recording double of IPEX (``intel_extension_for_pytorch``) and the ``torch.xpu`` device state.

Contract (platform_apis.md 1.5): ``ipex.llm.functional.varlen_attention(query,
key, value, out, seqlen_q, seqlen_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
pdropout, softmax_scale, zero_tensors, is_causal, return_softmax, gen_,
window_size_left=-1, window_size_right=-1, softcap=-1.0)``: TND tensors,
``seqlen_*`` CUDA-style int32 device offsets (B+1, leading 0), the result
written into the preallocated ``out`` of q's shape and dtype; query and kv
head counts equal (vLLM's IPEX path expands GQA first). Only non-causal,
no-dropout, no-ALiBi, unwindowed calls are emulated (the XPU platform makes
no other), since IPEX's causal alignment for q shorter than k is undocumented.
"""
from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist

from .device import FakeDevice, vendor_module
from .recording import Recorder, cuda_offsets, reference_attention, require
from .scaled_mm import install_scaled_mm

HALF = (torch.float16, torch.bfloat16)


class IpexDouble:
    def __init__(self):
        self.recorder = Recorder()

    def module(self):
        functional = types.SimpleNamespace(varlen_attention=self.varlen_attention)
        return vendor_module("intel_extension_for_pytorch", __version__="2.8.10+xpu",
                             llm=types.SimpleNamespace(functional=functional))

    def varlen_attention(self, query, key, value, out, seqlen_q, seqlen_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                         pdropout, softmax_scale, zero_tensors, is_causal, return_softmax, gen_,
                         window_size_left=-1, window_size_right=-1, softcap=-1.0):
        call = self.recorder.record("varlen_attention", query=query, key=key, value=value, out=out, seqlen_q=seqlen_q,
                                    seqlen_k=seqlen_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                    softmax_scale=softmax_scale, is_causal=is_causal)
        require(query.dim() == 3 and key.dim() == 3 and value.shape == key.shape, "IPEX varlen: TND query/key/value")
        require(key.shape[1] == query.shape[1], f"IPEX varlen: equal head counts (expand GQA kv heads first), "
                                                f"got {query.shape[1]} query / {key.shape[1]} kv heads")
        require(query.dtype in HALF and key.dtype == query.dtype, f"IPEX varlen (XPU): fp16/bf16, got {query.dtype}")
        require(isinstance(out, torch.Tensor) and out.shape == query.shape and out.dtype == query.dtype,
                "IPEX varlen: out is preallocated with the query's shape and dtype")
        require(not is_causal, "IPEX double: is_causal is not emulated (alignment for q shorter than k undocumented)")
        require(pdropout == 0.0 and not zero_tensors and not return_softmax and gen_ is None and alibi_slopes is None,
                "IPEX varlen inference: pdropout=0, zero_tensors/return_softmax False, gen_/alibi None")
        require((window_size_left, window_size_right, softcap) == (-1, -1, -1.0), "IPEX double: no window / softcap")
        cu_q = cuda_offsets("seqlen_q", seqlen_q, query.shape[0])
        cu_k = cuda_offsets("seqlen_k", seqlen_k, key.shape[0])
        require(len(cu_q) == len(cu_k), "IPEX varlen: seqlen_q / seqlen_k batch sizes differ")
        require(isinstance(softmax_scale, float), f"IPEX varlen: softmax_scale is a float, got {softmax_scale!r}")
        call.notes.update(layout="TND", cu_seqlens="B+1 with leading 0")
        out.copy_(reference_attention(query, key, value, cu_q, cu_k, causal=False, scale=softmax_scale))


class XpuDoubles:
    def __init__(self, device: FakeDevice, ipex: IpexDouble | None, scaled_mm):
        self.device, self.ipex, self.scaled_mm = device, ipex, scaled_mm


def install_xpu(monkeypatch, *, count: int = 4, ipex: bool = True, graphs: bool = True, scaled_mm: bool = True,
                xccl: bool = True, name: str = "Intel(R) Arc(TM) Pro B70 Graphics") -> XpuDoubles:
    """``torch.xpu`` with ``count`` devices; IPEX, XPUGraph, the XPU _scaled_mm kernel and XCCL each optional."""
    device = FakeDevice(count=count, name=name, graph_class="XPUGraph" if graphs else None)
    device.install(monkeypatch, torch.xpu)
    if not graphs:
        monkeypatch.delattr(torch.xpu, "XPUGraph", raising=False)
    monkeypatch.setattr(dist, "is_xccl_available", lambda: xccl)
    real = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",
                        lambda op, key: scaled_mm if (op, key) == ("aten::_scaled_mm", "XPU") else real(op, key))
    double = IpexDouble() if ipex else None
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", double.module() if double else None)
    return XpuDoubles(device, double, install_scaled_mm(monkeypatch, torch.float8_e4m3fn))
