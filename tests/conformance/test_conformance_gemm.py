"""Resolved dense and grouped GEMMs against an oracle, per platform.

Quant schemes none / fp8_tensor / fp8_row; shapes that the fast kernels take
(features multiples of 16) and one they must refuse (40x24: the reference
answers it); grouped GEMMs with empty expert groups. Weights go through the
kernel's own ``prepare_weight`` exactly as ``omni.layers`` does at load.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from conformance_cases import DTYPES, RESOLVED, TOL, device_of, get_platform, oracles

QUANTS = ("none", "fp8_tensor", "fp8_row")
SHAPES = ((64, 48), (256, 128), (40, 24))  # (in, out)
LINEAR_GRID = list(itertools.product(DTYPES, QUANTS, SHAPES, (False, True)))
GROUPS = {"empty-mid": [5, 0, 17, 3], "one-busy": [0, 0, 9, 0], "even": [8, 8, 8, 8]}
GROUPED_GRID = list(itertools.product(DTYPES, QUANTS, SHAPES, GROUPS))


def _tol(dtype, quant):
    # fp8 kernels may write bf16 and cast (row-wise CUTLASS path); compare at bf16 precision then
    return TOL[torch.bfloat16] if quant != "none" and dtype != torch.bfloat16 else TOL[dtype]


def assert_matches(y, expected, dtype, quant, platform_name):
    """Within dtype tolerance; fp8 across devices may also flip a few e4m3 roundings.

    The absmax scale ``amax / 448`` is not bitwise portable (CUDA divides by a host
    scalar through a reciprocal), so a value that sits on an e4m3 rounding boundary
    can land one fp8 step apart on the device and on the CPU oracle. Such a flip moves
    one product term by at most 1/8 of its size: allow it on <= 1% of the outputs,
    bounded by an absolute 0.1 on these O(1) outputs.
    """
    y, expected = y.float().cpu(), expected.float()
    tol = _tol(dtype, quant)
    if quant == "none" or platform_name == "cpu":
        return torch.testing.assert_close(y, expected, **tol)
    off = ~torch.isclose(y, expected, **tol)
    assert off.float().mean() <= 0.01, f"{int(off.sum())} of {off.numel()} outputs off"
    torch.testing.assert_close(y, expected, atol=0.1, rtol=0)


def _rand(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


@pytest.mark.parametrize("dtype,quant,shape,bias", LINEAR_GRID,
                         ids=[f"{d}-{q}-{i}x{o}-bias{int(b)}" for d, q, (i, o), b in LINEAR_GRID])
def test_linear_matches_oracle(platform_name, dtype, quant, shape, bias):
    from omni.specs import GemmSpec

    (i, o), dt, dev = shape, DTYPES[dtype], device_of(platform_name)
    spec = GemmSpec(in_features=i, out_features=o, dtype=dt, quant=quant, bias=bias)
    impl = get_platform(platform_name).linear(spec)
    RESOLVED[(platform_name, "linear", dtype, quant, f"{i}x{o}")].add(impl.name)
    w = _rand(o, i, dtype=dt, device=dev, seed=1, scale=1 / math.sqrt(i))
    x = _rand(2, 5, i, dtype=dt, device=dev, seed=2)
    b = _rand(o, dtype=dt, device=dev, seed=3, scale=0.1) if bias else None
    y = impl(x, impl.prepare_weight(w), b)
    assert y.shape == (2, 5, o) and y.dtype == dt and y.device == x.device
    assert_matches(y, oracles(platform_name)[1](spec, x, w, b), dt, quant, platform_name)


@pytest.mark.parametrize("dtype,quant,shape,groups", GROUPED_GRID,
                         ids=[f"{d}-{q}-{i}x{o}-{g}" for d, q, (i, o), g in GROUPED_GRID])
def test_grouped_gemm_matches_oracle(platform_name, dtype, quant, shape, groups):
    from omni.specs import GroupedGemmSpec

    (i, o), dt, dev = shape, DTYPES[dtype], device_of(platform_name)
    sizes = GROUPS[groups]
    spec = GroupedGemmSpec(num_experts=len(sizes), in_features=i, out_features=o, dtype=dt, quant=quant)
    impl = get_platform(platform_name).grouped_gemm(spec)
    RESOLVED[(platform_name, "grouped", dtype, quant, f"{i}x{o}")].add(impl.name)
    w = _rand(len(sizes), o, i, dtype=dt, device=dev, seed=4, scale=1 / math.sqrt(i))
    x = _rand(sum(sizes), i, dtype=dt, device=dev, seed=5)
    offsets = torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32, device=dev)
    y = impl(x, impl.prepare_weight(w), offsets)
    assert y.shape == (sum(sizes), o) and y.dtype == dt and y.device == x.device
    assert_matches(y, oracles(platform_name)[2](spec, x, w, offsets), dt, quant, platform_name)


@pytest.mark.parametrize("rows", ["bf16", "fp16"])
def test_fp32_linear_takes_lower_precision_rows_as_their_fp32_value(platform_name, rows):
    """The router: an fp32 linear fed the model's bf16 rows computes the fp32 product of those exact values."""
    from omni.specs import GemmSpec

    dev = device_of(platform_name)
    spec = GemmSpec(in_features=256, out_features=64, dtype=torch.float32)
    impl = get_platform(platform_name).linear(spec)
    RESOLVED[(platform_name, "linear", "fp32", f"{rows} rows", "256x64")].add(impl.name)
    w = _rand(64, 256, dtype=torch.float32, device=dev, seed=6, scale=1 / 16)
    x = _rand(3, 7, 256, dtype=DTYPES[rows], device=dev, seed=7)
    y = impl(x, impl.prepare_weight(w), None)
    assert y.shape == (3, 7, 64) and y.dtype == torch.float32
    exact = (x.double() @ w.double().T).float()
    torch.testing.assert_close(y.cpu(), exact.cpu(), atol=1e-5, rtol=1e-5)
