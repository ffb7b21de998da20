"""Reference quantization math shared by the reference platform and tests.

These define what a quantized GEMM *means*; platform kernels must match them
within the conformance tolerances. e4m3 max is 448 (OCP float8_e4m3fn).
"""
from __future__ import annotations

import torch

from .specs import PreparedWeight

FP8_MAX = 448.0
INT8_MAX = 127.0
_EPS = 1e-12


def absmax_scale(x: torch.Tensor, qmax: float, dim: int | None) -> torch.Tensor:
    """fp32 scale so that ``x / scale`` fits ``[-qmax, qmax]``; per tensor or keepdim along ``dim``."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return (amax.float() / qmax).clamp_min(_EPS)


def quantize_fp8(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales (``[]`` per tensor, ``[..., 1]`` per row)."""
    scale = absmax_scale(x, FP8_MAX, -1 if per_row else None)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row (last dim) with fp32 scales ``[..., 1]``."""
    scale = absmax_scale(x, INT8_MAX, -1)
    return (x.float() / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def prepare_weight(w: torch.Tensor, scheme: str) -> PreparedWeight:
    """Quantize a ``[O, I]`` or ``[E, O, I]`` weight for ``scheme`` (reference layout)."""
    if scheme == "none":
        return PreparedWeight(w)
    if scheme in ("fp8_tensor", "fp8_row"):
        if scheme == "fp8_tensor" and w.dim() == 3:  # one scale per expert
            q, s = zip(*(quantize_fp8(we, per_row=False) for we in w))
            return PreparedWeight(torch.stack(q), torch.stack(s).view(-1, 1, 1))
        return PreparedWeight(*quantize_fp8(w, per_row=scheme == "fp8_row"))
    if scheme == "w8a8":
        return PreparedWeight(*quantize_int8(w))
    raise ValueError(f"no reference quantization for scheme {scheme!r}")


def dequantize(w: PreparedWeight) -> torch.Tensor:
    """fp32 weight back from its prepared form."""
    return w.data.float() if w.scale is None else w.data.float() * w.scale


def quantized_linear(x_TI: torch.Tensor, w: PreparedWeight, scheme: str) -> torch.Tensor:
    """Reference product: dynamic activation quantization, fp32 accumulate, no bias."""
    if scheme == "none":
        return torch.nn.functional.linear(x_TI, w.data)
    if scheme == "w8a8":
        xq, xs = quantize_int8(x_TI)
    else:
        xq, xs = quantize_fp8(x_TI, per_row=scheme == "fp8_row")
    y = torch.nn.functional.linear(xq.float() * xs, dequantize(w))
    return y.to(x_TI.dtype)
