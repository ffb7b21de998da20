"""GEMMs of the MUSA platform: none yet, each declined with its reason.

May assume: nothing (no device is touched). The reference answers both:
``F.linear`` runs on muBLAS, the expert loop on ``F.linear`` per expert.
torch_musa's FP8 ``_scaled_mm`` needs MUSA arch >= 3.1 and is not wired yet;
torch_musa has no grouped GEMM (``_grouped_mm``).
"""
from __future__ import annotations

from omni.specs import GemmSpec, GroupedGemmSpec

from .capabilities import MusaCaps


def resolve_linear(spec: GemmSpec, caps: MusaCaps, reject):
    if spec.quant == "none":
        return reject("musa: unquantized linears are F.linear (muBLAS); the reference serves them")
    return reject(f"musa: quant {spec.quant!r} lands later (torch_musa's FP8 _scaled_mm needs MUSA arch >= 3.1)")


def resolve_grouped(spec: GroupedGemmSpec, caps: MusaCaps, reject):
    return reject("musa: torch_musa has no grouped GEMM (_grouped_mm); the reference expert loop serves it")
