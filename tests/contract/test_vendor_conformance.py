"""The conformance comparisons, run against each double-backed vendor platform.

For every spec of the conformance grid (``tests/conformance/conformance_cases``:
dtypes, head dims, GQA, varlen batches, masks none/causal/dense, paged KV),
the kernel the vendor platform resolves must (1) be the one its selection
rules promise for that device (``expected_*`` below), (2) make only calls the
vendor contract allows (the doubles raise ``ContractViolation`` otherwise;
every vendor kernel must have made at least one recorded call), and (3)
match the reference within the dtype tolerance. GEMMs likewise, with W8A8
and the grouped (MoE) variant.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from conformance_cases import (DTYPES, TOL, attention_grid, attention_spec, make_attention_case, reference_attention,
                               reference_grouped, reference_linear)
from omni.specs import GemmSpec, GroupedGemmSpec

HALF = ("bf16", "fp16")
GRID = list(attention_grid())


def expected_attention(variant: str, dtype, head_dim, gqa, mask, page) -> str:
    """Which kernel each device's rules pick for a spec of the grid (head dims 64/128)."""
    half = dtype in HALF
    if variant.startswith("rocm"):
        return "rocm-aiter" if half and mask != "dense" and not page else "rocm-sdpa"
    if variant.startswith("npu"):
        fia = half and mask != "dense" and (head_dim == 128 or gqa == 1) and page % 128 == 0
        return "npu-fia" if fia else "reference-sdpa" if page else "npu-sdpa"
    if variant.startswith("xpu"):
        return "xpu-ipex-varlen" if half and mask == "none" and not page else "xpu-sdpa"
    if variant.startswith("musa"):
        return "musa-flash" if half and mask != "dense" and not page else "musa-sdpa"
    raise AssertionError(variant)


VENDOR_KERNELS = {"rocm-aiter", "npu-fia", "xpu-ipex-varlen", "musa-flash"}


@pytest.mark.parametrize("dtype,head_dim,gqa,mask,page,batch", GRID,
                         ids=[f"{d}-h{h}-gqa{g}-{m}-page{p}-{b}" for d, h, g, m, p, b in GRID])
def test_attention_matches_reference_and_contract(vendor, dtype, head_dim, gqa, mask, page, batch):
    spec = attention_spec(dtype, head_dim, gqa, mask, page)
    impl = vendor.platform.attention(spec)
    assert impl.name == expected_attention(vendor.variant, dtype, head_dim, gqa, mask, page)
    q, k, v, meta = make_attention_case(spec, batch, "cpu")
    before = len(vendor.calls())
    out = impl(q, k, v, meta)
    assert out.shape == q.shape and out.dtype == q.dtype
    if impl.name in VENDOR_KERNELS:
        assert len(vendor.calls()) > before, f"{impl.name} answered without calling the vendor module"
    torch.testing.assert_close(out.float(), reference_attention(spec, q, k, v, meta).float(), **TOL[spec.dtype])


# ----------------------------------------------------------------- GEMMs

QUANTS = ("none", "fp8_tensor", "fp8_row", "w8a8")
SHAPES = ((64, 48), (256, 128), (40, 24))  # (in, out); 40x24 is not a multiple of 16
LINEAR_GRID = list(itertools.product(DTYPES, QUANTS, SHAPES, (False, True)))


def expected_linear(variant: str, dtype, quant, shape) -> str:
    aligned = shape[0] % 16 == 0 and shape[1] % 16 == 0
    if variant.startswith("rocm") and quant.startswith("fp8") and aligned:
        return f"rocm-scaled-mm[{quant},{'e4m3fnuz' if variant == 'rocm-mi300x' else 'e4m3fn'}]"
    if variant.startswith("npu") and quant == "w8a8" and dtype in HALF:
        return "npu-quant-matmul[w8a8]"
    if variant.startswith("xpu") and quant == "fp8_tensor" and aligned:
        return "xpu-scaled-mm[fp8_tensor]"
    return f"reference-linear[{quant}]"


def _rand(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype,quant,shape,bias", LINEAR_GRID,
                         ids=[f"{d}-{q}-{i}x{o}-bias{int(b)}" for d, q, (i, o), b in LINEAR_GRID])
def test_linear_matches_reference_and_contract(vendor, dtype, quant, shape, bias):
    (i, o), dt = shape, DTYPES[dtype]
    spec = GemmSpec(in_features=i, out_features=o, dtype=dt, quant=quant, bias=bias)
    impl = vendor.platform.linear(spec)
    assert impl.name == expected_linear(vendor.variant, dtype, quant, shape)
    w = _rand(o, i, dtype=dt, seed=1, scale=1 / math.sqrt(i))
    x, b = _rand(2, 5, i, dtype=dt, seed=2), _rand(o, dtype=dt, seed=3, scale=0.1) if bias else None
    before = len(vendor.calls())
    y = impl(x, impl.prepare_weight(w), b)
    assert y.shape == (2, 5, o) and y.dtype == dt
    if not impl.name.startswith("reference"):
        assert len(vendor.calls()) > before, f"{impl.name} answered without a recorded vendor call"
    tol = TOL[torch.bfloat16] if quant != "none" and dt != torch.bfloat16 else TOL[dt]
    torch.testing.assert_close(y.float(), reference_linear(spec, x, w, b).float(), **tol)


GROUPS = {"empty-mid": [5, 0, 17, 3], "one-busy": [0, 0, 9, 0], "even": [8, 8, 8, 8]}
GROUPED_GRID = list(itertools.product(DTYPES, ("none", "w8a8"), ((64, 48), (40, 24)), GROUPS))


def expected_grouped(variant: str, dtype, quant) -> str:
    if variant.startswith("npu") and (quant == "none" or dtype in HALF):
        return f"npu-grouped-matmul[{quant}]"
    return f"reference-grouped[{quant}]"


@pytest.mark.parametrize("dtype,quant,shape,groups", GROUPED_GRID,
                         ids=[f"{d}-{q}-{i}x{o}-{g}" for d, q, (i, o), g in GROUPED_GRID])
def test_grouped_gemm_matches_reference_and_contract(vendor, dtype, quant, shape, groups):
    (i, o), dt, sizes = shape, DTYPES[dtype], GROUPS[groups]
    spec = GroupedGemmSpec(num_experts=len(sizes), in_features=i, out_features=o, dtype=dt, quant=quant)
    impl = vendor.platform.grouped_gemm(spec)
    assert impl.name == expected_grouped(vendor.variant, dtype, quant)
    w = _rand(len(sizes), o, i, dtype=dt, seed=4, scale=1 / math.sqrt(i))
    x = _rand(sum(sizes), i, dtype=dt, seed=5)
    offsets = torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32)
    y = impl(x, impl.prepare_weight(w), offsets)
    assert y.shape == (sum(sizes), o) and y.dtype == dt
    tol = TOL[torch.bfloat16] if quant != "none" and dt != torch.bfloat16 else TOL[dt]
    torch.testing.assert_close(y.float(), reference_grouped(spec, x, w, offsets).float(), **tol)
