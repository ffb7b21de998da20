"""The glue's optional ``conv3x3`` / ``conv3x3_weights`` (the image heads' 3x3 convolutions) against the
definition ``omni.winograd.conv3x3_winograd`` and a float64 direct convolution.

The kernel computes the definition's roundings (V and U in the input dtype, fp32 GEMMs and transforms, one
rounding, then the addend), so it must agree with it within fp32 summation order: at most one rounding step of
the output dtype (of the convolution, then of its sum with the addend), almost everywhere none. Against the
exact convolution of the same values, F(2x2, 3x3)'s extra roundings (V and U in bf16) cost about half as much
again as the output's own rounding: the bound is
1.5 half-ulps of relative L2 (at the released widths on an H200 a direct bf16 convolution measured 0.55, the
kernel 0.82: BENCHMARKS.md, "Thirtieth session").
Platforms whose glue has no ``conv3x3`` (the reference) skip: their heads keep torch's convolutions.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conformance_cases import RESOLVED, device_of, get_platform
from omni.specs import GlueSpec
from omni.winograd import conv3x3_winograd

# (B, C in, C out, H, W, layout, addend, dtype): the heads' NHWC bf16 chain with the skip branch, an odd grid
# (tiles hanging over both edges), widths that are not a multiple of the kernels' channel block, NCHW, fp32;
# widths the cuda glue takes (in x out >= 4096 x 1024), small grids
CASES = {
    "heads-nhwc-addend": (1, 1024, 4096, 8, 8, "cl", True, torch.bfloat16),
    "odd-grid": (2, 4096, 1024, 9, 7, "cl", False, torch.bfloat16),
    "odd-widths": (1, 2100, 2060, 6, 10, "cl", True, torch.bfloat16),
    "nchw-input": (2, 2048, 2048, 8, 5, "nc", True, torch.bfloat16),
    "fp32": (1, 2048, 2048, 7, 7, "cl", False, torch.float32),
}
HALF_ULP = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -11}  # fp32: TF32's, whose GEMMs may be allowed


def _glue(platform_name: str):
    glue = get_platform(platform_name).glue(GlueSpec(hidden=64, head_dim=16, eps=1e-5, dtype=torch.bfloat16))
    if not hasattr(glue, "conv3x3"):
        pytest.skip(f"{glue.name} has no conv3x3 (the image heads keep torch's convolutions)")
    RESOLVED[("conv3x3",)].add(glue.name)
    return glue


def _inputs(case: str, dev: str):
    B, C, O, H, W, layout, addend, dtype = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    x = torch.randn(B, C, H, W, generator=g).to(dtype)
    w = (torch.randn(O, C, 3, 3, generator=g) / (3 * C ** 0.5)).to(dtype)
    b = torch.randn(O, generator=g).to(dtype)
    a = torch.randn(B, O, H, W, generator=g).to(dtype) if addend else None
    x, w, b = x.to(dev), w.to(dev), b.to(dev)
    if layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, w, b, (a.to(dev) if a is not None else None)


@pytest.mark.parametrize("case", list(CASES))
def test_conv3x3_matches_the_definition_and_the_exact_convolution(platform_name, case):
    glue, dev = _glue(platform_name), device_of(platform_name)
    x, w, b, a = _inputs(case, dev)
    u = glue.conv3x3_weights(w)
    assert u is not None, f"{glue.name} refused a {tuple(w.shape)} convolution"
    y = glue.conv3x3(x, u, b, a)
    assert y.shape == (x.shape[0], w.shape[0], *x.shape[2:]) and y.dtype == x.dtype
    conv = conv3x3_winograd(x, u, b)
    ref = conv if a is None else a + conv
    # one rounding step of the convolution (fp32 summation order), carried through the addend's rounding
    mag = conv.float().abs().clamp_min(1.0) + (0 if a is None else ref.float().abs().clamp_min(1.0))
    step = HALF_ULP[x.dtype] * 2 * mag
    diff = (y.float() - ref.float()).abs()
    assert bool((diff <= step).all()), f"{case}: {float((diff / step).max()):.2f} rounding steps from the definition"
    assert float((diff > 0).float().mean()) < 0.02, f"{case}: the kernel rounds differently from the definition"
    exact = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    exact = exact if a is None else a.double() + exact
    rel = float((y.double() - exact).norm() / exact.norm())
    assert rel <= 1.5 * HALF_ULP[x.dtype], f"{case}: relative L2 {rel:.2e} from the exact convolution"

