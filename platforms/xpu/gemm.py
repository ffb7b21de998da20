"""FP8 GEMMs of the XPU platform (``torch._scaled_mm`` on oneDNN), where this torch has them.

May assume: weights and activations live on the worker's XPU. Quantization is
``omni.quant``'s (OCP e4m3, absmax scales, dynamic per-tensor activations),
so a prepared weight dequantizes exactly as the reference's does.
Only tensor-wise scaling is wired: row-wise and block-wise ``_scaled_mm`` on
XPU arrive across torch 2.10-2.16 (blockwise needs oneDNN > 3.11) and are not
verified here. Unquantized linears and grouped (expert) GEMMs are declined:
the reference answers them (``F.linear``; an expert loop).
"""
from __future__ import annotations

import torch

from omni import quant
from omni.specs import GemmSpec, GroupedGemmSpec, PreparedWeight

from .capabilities import XpuCaps

LATER = {
    "fp8_row": "fp8_row (row-wise _scaled_mm) on XPU is unverified; lands when measured",
    "mxfp8": "mxfp8 needs block-scaled _scaled_mm (oneDNN > 3.11); lands later",
    "nvfp4": "nvfp4 is an NVIDIA format; lands later",
    "w8a8": "w8a8 int8 kernels land later",
}


class ScaledMmLinear:
    """``torch._scaled_mm`` with e4m3 weights and a dynamic per-tensor activation scale."""

    name = "xpu-scaled-mm[fp8_tensor]"

    def __init__(self, spec: GemmSpec):
        self.spec = spec

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight:
        return quant.prepare_weight(w_OI.contiguous(), "fp8_tensor")

    def __call__(self, x_TI, w: PreparedWeight, bias_O=None) -> torch.Tensor:
        lead, x = x_TI.shape[:-1], x_TI.reshape(-1, self.spec.in_features).to(self.spec.dtype)
        xq, x_scale = quant.quantize_fp8(x, per_row=False)
        y = torch._scaled_mm(xq, w.data.t(), scale_a=x_scale, scale_b=w.scale, out_dtype=self.spec.dtype)
        y = y if bias_O is None else y + bias_O
        return y.reshape(*lead, self.spec.out_features)


def resolve_linear(spec: GemmSpec, caps: XpuCaps, reject):
    if spec.quant == "none":
        return reject("xpu: unquantized linears are F.linear (oneDNN); the reference serves them")
    if spec.quant in LATER:
        return reject(f"xpu: quant {spec.quant!r}: {LATER[spec.quant]}")
    if not caps.scaled_mm:
        return reject("xpu: this torch has no XPU kernel for aten::_scaled_mm (FP8)")
    if spec.in_features % 16 or spec.out_features % 16:
        return reject(f"xpu: torch._scaled_mm needs in/out features divisible by 16, "
                      f"got {spec.in_features}x{spec.out_features}")
    return ScaledMmLinear(spec)


def resolve_grouped(spec: GroupedGemmSpec, caps: XpuCaps, reject):
    return reject("xpu: grouped expert GEMMs (vllm-xpu-kernels / IPEX GatedMLPMOE) land later; "
                  "the reference expert loop serves them")
