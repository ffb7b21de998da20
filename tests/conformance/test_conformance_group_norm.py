"""The glue's optional ``group_norm`` ("GroupNorm [, FiLM], SiLU" in one pass) against a float64 oracle.

The oracle is written here with the documented roundings spelled out (``omni.group_norm.group_norm_act``):
the normalised value rounded to the norm dtype, FiLM's ``1 + scale``, product and sum each rounded there,
SiLU rounded there, then the output dtype. A kernel's fp32 statistics may move a value across one rounding
boundary, so most values must be bit-equal and the rest one rounding away. Platforms whose glue has no
``group_norm`` (the reference) skip: their models keep the torch ops.
"""
from __future__ import annotations

import pytest
import torch

from conformance_cases import RESOLVED, device_of, get_platform
from omni.specs import GlueSpec

# (shape, groups, layout, x dtype, norm dtype, out dtype, FiLM): the VAE's fp32 chain under fp16 autocast
# (channels-last 3-D, NCDHW, a level's 128 channels), the image heads' bf16 chain with FiLM (NHWC views of
# tokens), channels the kernels cannot tile (48 / 16 groups), a plain norm without SiLU.
CASES = {
    "vae-cl3d": ((1, 128, 2, 24, 24), 32, "cl", torch.float32, torch.float32, torch.float16, False, True),
    "vae-ncdhw": ((2, 64, 1, 16, 16), 32, "nc", torch.float32, torch.float32, torch.float16, False, True),
    "heads-nhwc-film": ((2, 256, 12, 10), 32, "cl", torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True),
    "heads-nchw-film": ((2, 256, 12, 10), 32, "nc", torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True),
    "odd-channels": ((2, 48, 5, 7), 16, "cl", torch.bfloat16, torch.bfloat16, torch.bfloat16, True, True),
    "norm-only": ((1, 64, 3, 9, 9), 32, "cl", torch.float32, torch.float32, torch.float32, False, False),
}
# relative spacing of a dtype; for float32 the fp32 statistics' error instead (means and variances of
# thousands of values summed in fp32, against float64)
ULP = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _glue_kernel(platform_name: str):
    glue = get_platform(platform_name).glue(GlueSpec(hidden=64, head_dim=16, eps=1e-5, dtype=torch.bfloat16))
    if not hasattr(glue, "group_norm"):
        pytest.skip(f"{glue.name} has no group_norm (the image heads and the VAE keep their torch ops)")
    RESOLVED[("group_norm",)].add(glue.name)
    return glue.group_norm


def naive_group_norm_act(x, G, w, b, eps, norm_dtype, out_dtype, silu, scale=None, shift=None):
    B, C = x.shape[:2]
    per_channel = (B, C) + (1,) * (x.dim() - 2)
    xg = x.double().reshape(B, G, -1)
    mean, var = xg.mean(-1, keepdim=True), xg.var(-1, unbiased=False, keepdim=True)
    n = ((xg - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    y = (n * w.double().view(1, C, *per_channel[2:]) + b.double().view(1, C, *per_channel[2:])).to(norm_dtype)
    if scale is not None:
        opl = (1 + scale.double()).to(norm_dtype).double().view(per_channel)
        y = (y.double() * opl).to(norm_dtype)
        y = (y.double() + shift.double().view(per_channel)).to(norm_dtype)
    if silu:
        y = (y.double() * torch.sigmoid(y.double())).to(norm_dtype)
    return y.to(out_dtype)


def _inputs(case: str, dev: str, offset: float = 0.5):
    shape, G, layout, xdt, _, _, film, _ = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    x = (torch.randn(*shape, generator=g) * 2 + offset).to(xdt)
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}[x.dim()]
    x = x.contiguous(memory_format=fmt) if layout == "cl" else x
    C, B = shape[1], shape[0]
    w, b = torch.randn(C, generator=g).to(xdt), torch.randn(C, generator=g).to(xdt)
    # a strided view, as chunk gives
    scale = (torch.randn(B, 2 * C, generator=g) * 0.5).to(xdt)[:, :C] if film else None
    shift = torch.randn(B, C, generator=g).to(xdt) if film else None
    return [t.to(dev) if t is not None else None for t in (x, w, b, scale, shift)], G


@pytest.mark.parametrize("case", sorted(CASES))
def test_group_norm_matches_the_oracle_rounding_for_rounding(platform_name, case):
    kernel = _glue_kernel(platform_name)
    (x, w, b, scale, shift), G = _inputs(case, device_of(platform_name))
    _, _, layout, _, nd, od, _, silu = CASES[case]
    y = kernel(x, G, w, b, 1e-6, norm_dtype=nd, out_dtype=od, silu=silu, scale_BC=scale, shift_BC=shift)
    want = naive_group_norm_act(x.cpu(), G, w.cpu(), b.cpu(), 1e-6, nd, od, silu,
                                None if scale is None else scale.cpu(), None if shift is None else shift.cpu())
    assert y.dtype == od and y.shape == x.shape and y.stride() == x.stride()  # the layout is kept
    diff = (y.cpu().double() - want.double()).abs()
    # one rounding of the norm or output dtype, at most twice; FiLM's (1 + scale) multiplies an earlier one by ~3
    bound = 2 * max(ULP[nd], ULP[od]) * (want.double().abs() + 1) * (4 if scale is not None else 1)
    assert (diff <= bound).all(), f"{case}: max diff {diff.max().item():.3g}"
    if od != torch.float32:  # a rounded output: most values land on the oracle's bits
        assert (diff > 0).double().mean() < 0.02, f"{case}: {(diff > 0).double().mean().item():.3%} of values differ"


def test_a_mean_far_from_zero_keeps_its_variance(platform_name):
    """Statistics merged per tile (no E[x^2] - mean^2): x = 1000 + N(0, 1) normalises to N(0, 1) in fp32."""
    kernel = _glue_kernel(platform_name)
    (x, w, b, _, _), G = _inputs("norm-only", device_of(platform_name), offset=1000.0)
    y = kernel(x, G, w, b, 1e-6, norm_dtype=torch.float32, out_dtype=torch.float32, silu=False)
    want = naive_group_norm_act(x.cpu(), G, w.cpu(), b.cpu(), 1e-6, torch.float32, torch.float64, False)
    assert ((y.cpu().double() - want).norm() / want.norm()).item() < 1e-4


def test_an_empty_batch_gives_an_empty_result(platform_name):
    kernel = _glue_kernel(platform_name)
    dev = device_of(platform_name)
    x, w = torch.zeros(0, 64, 4, 4, device=dev), torch.ones(64, device=dev)
    y = kernel(x, 32, w, w, 1e-6, norm_dtype=torch.float32, out_dtype=torch.float16, silu=True)
    assert y.shape == x.shape and y.dtype == torch.float16
