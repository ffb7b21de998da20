"""FP8 GEMMs of the ROCm platform (``torch._scaled_mm`` on hipBLASLt).

May assume: weights and activations live on the worker's device. The
quantization is ``omni.quant``'s (absmax scales, dynamic activations), so a
prepared weight dequantizes exactly as the reference's does.

FP8 formats: MI300-class (gfx942) computes in ``float8_e4m3fnuz``, MI350
(gfx950) and RDNA4 in OCP ``float8_e4m3fn``. fnuz values are the OCP values
halved (exponent bias 8 instead of 7), so quantizing with the OCP absmax
scale doubled (largest code 224, not fnuz's 240) gives bit for bit the
reference's dequantized values; vLLM's ``normalize_e4m3fn_to_e4m3fnuz`` does
the same for checkpoints. Row-wise ``_scaled_mm`` on ROCm writes bf16 only.

Layouts: ``PreparedWeight.data`` stays ``[O, I]`` row-major; ``_scaled_mm``
gets the free transposed view (``[I, O]`` column-major). Unquantized linears
and grouped (expert) GEMMs are declined: the reference answers them
(``F.linear``; an expert loop) until aiter's fused-MoE kernels are wired.
"""
from __future__ import annotations

import torch

from omni import quant
from omni.specs import GemmSpec, GroupedGemmSpec, PreparedWeight

from .capabilities import RocmCaps

FNUZ_MAX = 224.0  # 448 / 2: keeps fnuz codes = OCP codes / 2 (see the module docstring)
LATER = {
    "mxfp8": "mxfp8 needs gfx950 block-scaled kernels (e8m0 scales); lands later",
    "nvfp4": "nvfp4 is an NVIDIA format (ROCm's fp4 is MXFP4 on gfx950); lands later",
    "w8a8": "w8a8 int8 kernels land later",
}


def quantize(x: torch.Tensor, per_row: bool, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes in ``fp8_dtype`` and fp32 scales with the reference's dequantized values."""
    if fp8_dtype == torch.float8_e4m3fn:
        return quant.quantize_fp8(x, per_row=per_row)
    scale = quant.absmax_scale(x, FNUZ_MAX, -1 if per_row else None)
    return (x.float() / scale).clamp(-FNUZ_MAX, FNUZ_MAX).to(fp8_dtype), scale


class ScaledMmLinear:
    """``torch._scaled_mm`` with fp8 weights and dynamic per-tensor / per-token activations."""

    def __init__(self, spec: GemmSpec, fp8_dtype: torch.dtype):
        self.spec, self.fp8, self.per_row = spec, fp8_dtype, spec.quant == "fp8_row"
        self.name = f"rocm-scaled-mm[{spec.quant},{str(fp8_dtype).removeprefix('torch.float8_')}]"
        self.out_dtype = torch.bfloat16 if self.per_row else spec.dtype

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight:
        return PreparedWeight(*quantize(w_OI.contiguous(), self.per_row, self.fp8))

    def __call__(self, x_TI, w: PreparedWeight, bias_O=None) -> torch.Tensor:
        lead, x = x_TI.shape[:-1], x_TI.reshape(-1, self.spec.in_features).to(self.spec.dtype)
        xq, x_scale = quantize(x, self.per_row, self.fp8)
        w_scale = w.scale.view(1, -1) if self.per_row else w.scale
        y = torch._scaled_mm(xq, w.data.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=self.out_dtype)
        y = y.to(self.spec.dtype) if bias_O is None else y.to(self.spec.dtype) + bias_O
        return y.reshape(*lead, self.spec.out_features)


def resolve_linear(spec: GemmSpec, caps: RocmCaps, reject):
    if spec.quant == "none":
        return reject("rocm: unquantized linears are F.linear (hipBLASLt); the reference serves them")
    if spec.quant in LATER:
        return reject(f"rocm: quant {spec.quant!r}: {LATER[spec.quant]}")
    if not caps.has_scaled_mm:
        return reject("rocm: torch._scaled_mm is not in this torch")
    if caps.fp8_dtype is None:
        return reject(f"rocm: {spec.quant} needs FP8 matrix cores (gfx942, gfx950, gfx1200/1201), "
                      f"this device is {caps.arch or 'unknown'}")
    if spec.in_features % 16 or spec.out_features % 16:
        return reject(f"rocm: torch._scaled_mm needs in/out features divisible by 16, "
                      f"got {spec.in_features}x{spec.out_features}")
    return ScaledMmLinear(spec, caps.fp8_dtype)


def resolve_grouped(spec: GroupedGemmSpec, caps: RocmCaps, reject):
    return reject("rocm: grouped expert GEMMs (aiter fused MoE) land later; the reference expert loop serves them")
