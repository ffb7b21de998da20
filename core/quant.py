"""Reference quantization math shared by the reference platform and tests.

These define what a quantized GEMM *means*; platform kernels must match them
within the conformance tolerances. e4m3 max is 448 (OCP float8_e4m3fn).
"""
from __future__ import annotations

import torch

from .specs import PreparedWeight

FP8_MAX = 448.0
INT8_MAX = 127.0
SCALE_EPS = 1e-12  # the smallest scale: an all-zero tensor quantizes to zeros, not NaN


def absmax_scale(x: torch.Tensor, qmax: float, dim: int | None) -> torch.Tensor:
    """fp32 scale so that ``x / scale`` fits ``[-qmax, qmax]``; per tensor or keepdim along ``dim``."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return scale_from_amax(amax, qmax)


def scale_from_amax(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The scale of an absolute maximum, by these torch ops wherever a kernel must give the same bits: a kernel's
    correctly rounded quotient differed from torch's CUDA division by a Python scalar (BENCHMARKS.md, "Forty-seventh
    session")."""
    return (amax.float() / qmax).clamp_min(SCALE_EPS)


def quantize_fp8(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and fp32 scales (``[]`` per tensor, ``[..., 1]`` per row)."""
    scale = absmax_scale(x, FP8_MAX, -1 if per_row else None)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fake_quantize_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` through e4m3 and back with one dynamic scale (per tensor), in ``x.dtype``: what an fp8 product sees."""
    q, scale = quantize_fp8(x, per_row=False)
    return (q.float() * scale).to(x.dtype)


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
    return rows_linear(xq, xs, w, x_TI.dtype)


def rows_linear(xq_TI: torch.Tensor, xs: torch.Tensor, w: PreparedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The reference product of rows quantized already (``xq * xs``) with a prepared weight, fp32, as ``dtype``."""
    return torch.nn.functional.linear(xq_TI.float() * xs, dequantize(w)).to(dtype)


# ----------------------------------------------------------------- pre-quantized checkpoints

# ModelOpt ``hf_quant_config.json`` / ``config.json: quantization_config`` algorithm names -> quant.scheme
CHECKPOINT_ALGOS = {"fp8": "fp8_tensor", "fp8_per_channel_per_token": "fp8_row", "fp8_pc_pt": "fp8_row",
                    "nvfp4": "nvfp4", "mxfp8": "mxfp8"}


def checkpoint_scheme(root) -> str | None:
    """The quantization a checkpoint directory was saved with (ModelOpt-style metadata), or None.

    Reads ``hf_quant_config.json`` (``{"quantization": {"quant_algo": "FP8"}}``) or
    ``config.json``'s ``quantization_config`` (``quant_algo`` or ``quant_method``).
    """
    import json
    from pathlib import Path

    root = Path(root)
    algo = None
    if (root / "hf_quant_config.json").is_file():
        algo = json.loads((root / "hf_quant_config.json").read_text()).get("quantization", {}).get("quant_algo")
    elif (root / "config.json").is_file():
        qc = json.loads((root / "config.json").read_text()).get("quantization_config") or {}
        algo = qc.get("quant_algo") or qc.get("quant_method")
    if not algo:
        return None
    scheme = CHECKPOINT_ALGOS.get(str(algo).lower())
    if scheme is None:
        raise ValueError(f"{root}: checkpoint quantization {algo!r} is not supported "
                         f"(known: {', '.join(sorted(CHECKPOINT_ALGOS))})")
    return scheme


def checkpoint_refusal(ckpt_scheme: str | None, recipe_scheme: str) -> str | None:
    """Why a checkpoint saved as ``ckpt_scheme`` cannot load under ``quant.scheme=recipe_scheme``; None if it can."""
    if ckpt_scheme is None:
        return None
    if ckpt_scheme in ("nvfp4", "mxfp8"):
        if recipe_scheme != ckpt_scheme:
            return (f"the checkpoint is {ckpt_scheme} (block-scaled); it loads only with quant.scheme={ckpt_scheme}, "
                    f"which the platform accepts or refuses at startup (CUDA needs compute capability 10.0)")
        return (f"quant.scheme={ckpt_scheme}: loading {ckpt_scheme} checkpoints is not implemented yet "
                f"(block scales would need the sm100 kernels); requantize from bf16 with quant.scheme=fp8_row")
    if recipe_scheme not in ("fp8_row", "fp8_tensor"):
        return f"the checkpoint is pre-quantized FP8 ({ckpt_scheme}); set quant.scheme=fp8_row or fp8_tensor"
    if ckpt_scheme == "fp8_row" and recipe_scheme == "fp8_tensor":
        return "the checkpoint has per-row FP8 scales; quant.scheme=fp8_tensor cannot hold them: use fp8_row"
    return None
