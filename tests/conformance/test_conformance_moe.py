"""The fused MoE hook (``omni_moe_impl``) against a naive float64 oracle written here, per platform.

The oracle loops over (token, choice) pairs: expert ``e``'s rows are gathered,
quantized the way the scheme says (fp8_row per row, fp8_tensor one scale per
expert group), multiplied in float64, gated by ``x1 * silu(x2)`` (SiLU on the
SECOND half), quantized again and multiplied by ``w2[e]``, then summed with the
routing weights. Routings: random, one busy expert (empty groups), and k = 1
(what expert parallelism passes). Weights go through the impl's own
``prepare_weights``. The CUDA impl's torch kernels also run here on CPU
tensors (``_grouped_mm`` exists on CPU; ``_scaled_grouped_mm`` is emulated).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from conformance_cases import DTYPES, RESOLVED, device_of, get_platform, naive_moe
from omni.specs import MoESpec

QUANTS = ("none", "fp8_tensor", "fp8_row")
SHAPES = {"E4-k2-64x48": (4, 2, 64, 48), "E8-k3-32x16": (8, 3, 32, 16)}  # (experts, topk, hidden, inner)
ROUTINGS = ("random", "one-busy", "k1")
GRID = list(itertools.product(("fp32", "bf16"), QUANTS, SHAPES, ROUTINGS))
REL = {("fp32", "none"): 1e-5, ("bf16", "none"): 1.5e-2}  # fp8: 3e-2 (rounding flips of intermediates)


def _rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def make_case(spec: MoESpec, routing: str, T: int = 23, seed: int = 0):
    E, D, inner = spec.num_experts, spec.hidden, spec.inner
    k = 1 if routing == "k1" else spec.topk
    x = _rand(T, D, seed=seed)
    w13 = _rand(E, 2 * inner, D, seed=seed + 1, scale=1 / math.sqrt(D))
    w2 = _rand(E, D, inner, seed=seed + 2, scale=1 / math.sqrt(inner))
    logits = _rand(T, E, seed=seed + 3)
    if routing == "one-busy":  # every token's first choice is expert 1; the rest spread over 2 experts
        logits[:, 1] += 100.0
        logits[:, 3:] -= 100.0
    wts, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return x, wts / wts.sum(-1, keepdim=True), ids, w13, w2


def rel_err(y, ref) -> float:
    y, ref = y.double().cpu(), ref.double().cpu()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def check(impl, spec, case, dtype_name, device):
    x, wts, ids, w13, w2 = case
    dt = spec.dtype
    prepared = impl.prepare_weights(w13.to(dt).to(device), w2.to(dt).to(device))
    y = impl(x.to(dt).to(device), wts.to(device), ids.to(device), prepared)
    assert y.shape == x.shape and y.dtype == dt and y.device.type == torch.device(device).type
    assert torch.isfinite(y).all()
    ref = naive_moe(spec, x, wts, ids, w13.to(dt), w2.to(dt))
    err = rel_err(y, ref)
    bound = REL.get((dtype_name, spec.quant), 3e-2)
    assert err <= bound, f"{impl.name}: relative error {err:.3g} > {bound}"
    return err


@pytest.mark.parametrize("dtype,quant,shape,routing", GRID, ids=[f"{d}-{q}-{s}-{r}" for d, q, s, r in GRID])
def test_moe_matches_naive_oracle(platform_name, dtype, quant, shape, routing):
    E, k, D, inner = SHAPES[shape]
    spec = MoESpec(num_experts=E, topk=k, hidden=D, inner=inner, dtype=DTYPES[dtype], quant=quant)
    impl = get_platform(platform_name).moe(spec)
    RESOLVED[(platform_name, "moe", dtype, quant, shape)].add(impl.name)
    check(impl, spec, make_case(spec, routing), dtype, device_of(platform_name))


def test_moe_refusal_names_the_recipe_field():
    from omni.platform_manager import NoImplementationError, select

    with pytest.raises(NoImplementationError, match="quant.scheme='nvfp4'"):
        select("cpu").moe(MoESpec(num_experts=4, topk=2, hidden=32, inner=16, dtype=torch.bfloat16, quant="nvfp4"))


# ----------------------------------------------------------------- the CUDA impl's logic on CPU tensors


FAST_ACCUM_SEEN: list[bool] = []  # use_fast_accum of every emulated call, in order


def _emulated_scaled_grouped_mm(xq, w_IO, scale_a, scale_b, offs, out_dtype, use_fast_accum=False):
    """``torch._scaled_grouped_mm`` semantics (2-D x 3-D, row-wise scales) in fp32 on the CPU."""
    FAST_ACCUM_SEEN.append(use_fast_accum)
    y = torch.zeros(xq.shape[0], w_IO.shape[-1], dtype=torch.float32)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            y[start:end] = (xq[start:end].float() * scale_a[start:end, None]) @ (w_IO[e].float() * scale_b[e][None])
        start = end
    return y.to(out_dtype)


@pytest.mark.parametrize("quant,shape,routing", list(itertools.product(QUANTS, SHAPES, ROUTINGS)))
def test_cuda_moe_torch_kernels_on_cpu(monkeypatch, quant, shape, routing):
    from omni.platforms.cuda.moe import CudaMoE, TorchKernels

    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm, raising=False)
    E, k, D, inner = SHAPES[shape]
    spec = MoESpec(num_experts=E, topk=k, hidden=D, inner=inner, dtype=torch.bfloat16, quant=quant)
    impl = CudaMoE(spec, kernels=TorchKernels())
    assert impl.name == f"cuda-fused-moe[{quant},torch]"
    check(impl, spec, make_case(spec, routing), "bf16", "cpu")


@pytest.mark.parametrize("quant", ["fp8_row", "fp8_tensor"])
def test_cuda_moe_passes_fast_accum_to_both_expert_gemms(monkeypatch, quant):
    from omni.platforms.cuda.moe import CudaMoE, TorchKernels

    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm, raising=False)
    for fast in (False, True):
        spec = MoESpec(num_experts=4, topk=2, hidden=64, inner=48, dtype=torch.bfloat16, quant=quant, fast_accum=fast)
        impl = CudaMoE(spec, kernels=TorchKernels())
        assert impl.name.endswith(",fast-accum]") == fast
        FAST_ACCUM_SEEN.clear()
        check(impl, spec, make_case(spec, "random"), "bf16", "cpu")
        assert FAST_ACCUM_SEEN and set(FAST_ACCUM_SEEN) == {fast}


def test_cuda_moe_resolution_reasons():
    from omni.platforms.cuda.capabilities import Caps
    from omni.platforms.cuda.moe import CudaMoE, resolve_moe

    h100 = Caps(sm=(9, 0), cuda_version=(13, 0), has_scaled_mm=True, has_grouped_mm=True, has_scaled_grouped_mm=True)
    spec = MoESpec(num_experts=64, topk=8, hidden=4096, inner=3072, dtype=torch.bfloat16, quant="fp8_row")
    reasons: list[str] = []
    assert isinstance(resolve_moe(spec, h100, reasons.append), CudaMoE) and not reasons
    cases = [
        (dataclasses.replace(spec, quant="nvfp4"), h100, "quant.scheme=nvfp4 needs compute capability 10.0"),
        (dataclasses.replace(spec, quant="mxfp8"), h100, "quant.scheme=mxfp8 needs compute capability 10.0"),
        (dataclasses.replace(spec, quant="nvfp4"), dataclasses.replace(h100, sm=(10, 0)), "quant.scheme=nvfp4: "),
        (dataclasses.replace(spec, dtype=torch.float32), h100, "bf16 only"),
        (spec, dataclasses.replace(h100, sm=(8, 9)), "sm90/sm100 only"),
        (spec, dataclasses.replace(h100, has_scaled_grouped_mm=False), "_scaled_grouped_mm is not in this torch"),
        (dataclasses.replace(spec, quant="none"), dataclasses.replace(h100, sm=(7, 5)), "sm80+"),
    ]
    for s, caps, why in cases:
        reasons = []
        assert resolve_moe(s, caps, reasons.append) is None
        assert why in reasons[0], reasons


# ----------------------------------------------------------------- addends (accepts_addends)


def _addends(T: int, D: int, dtype, device, seed: int = 7):
    return tuple(_rand(T, D, seed=seed + i).to(dtype).to(device) for i in range(2))


@pytest.mark.parametrize("quant", QUANTS)
def test_moe_addends_join_the_combine(platform_name, quant):
    """An impl that ``accepts_addends`` returns ``sum(addends) + MoE(x)`` (the fp64 oracle plus the addends)."""
    E, k, D, inner = SHAPES["E8-k3-32x16"]
    spec = MoESpec(num_experts=E, topk=k, hidden=D, inner=inner, dtype=torch.bfloat16, quant=quant)
    impl = get_platform(platform_name).moe(spec)
    if not getattr(impl, "accepts_addends", False):
        pytest.skip(f"{impl.name} does not take addends (the model adds them itself)")
    dev = device_of(platform_name)
    x, wts, ids, w13, w2 = make_case(spec, "random")
    prepared = impl.prepare_weights(w13.bfloat16().to(dev), w2.bfloat16().to(dev))
    a = _addends(x.shape[0], D, torch.bfloat16, dev)
    y = impl(x.bfloat16().to(dev), wts.to(dev), ids.to(dev), prepared, addends=a)
    ref = naive_moe(spec, x, wts, ids, w13.bfloat16(), w2.bfloat16()) + sum(t.double().cpu() for t in a)
    assert rel_err(y, ref) <= 3e-2


@pytest.mark.parametrize("quant", QUANTS)
def test_cuda_moe_addends_on_cpu(monkeypatch, quant):
    """The CUDA MoE's torch kernels: addends add in fp32 before the one rounding (a zero addend changes no bit;
    the sum differs from the separate bf16 adds by at most their roundings), and the oracle agrees."""
    from omni.platforms.cuda.moe import CudaMoE, TorchKernels

    monkeypatch.setattr(torch, "_scaled_grouped_mm", _emulated_scaled_grouped_mm, raising=False)
    E, k, D, inner = SHAPES["E4-k2-64x48"]
    spec = MoESpec(num_experts=E, topk=k, hidden=D, inner=inner, dtype=torch.bfloat16, quant=quant)
    impl = CudaMoE(spec, kernels=TorchKernels())
    assert impl.accepts_addends
    x, wts, ids, w13, w2 = make_case(spec, "random")
    prepared = impl.prepare_weights(w13.bfloat16(), w2.bfloat16())
    x = x.bfloat16()
    alone = impl(x, wts, ids, prepared)
    assert torch.equal(impl(x, wts, ids, prepared, addends=(torch.zeros_like(x),)), alone)
    h, shared = _addends(x.shape[0], D, torch.bfloat16, "cpu")
    fused = impl(x, wts, ids, prepared, addends=(h, shared))
    separate = h + (shared + alone)  # what the model does without addends: three bf16 roundings more
    f = [t.float().abs() for t in (alone, shared + alone, separate)]
    half_ulps = 2 ** -8 * (f[0] + f[1] + 2 * f[2]) + 2 ** -24  # bf16: half an ulp <= 2^-8 |v|
    assert ((fused.float() - separate.float()).abs() <= half_ulps).all()
    assert not torch.equal(fused, separate)  # the roundings differ somewhere: the fused path really ran
    ref = naive_moe(spec, x.float(), wts, ids, w13.bfloat16(), w2.bfloat16()) + h.double() + shared.double()
    assert rel_err(fused, ref) <= 3e-2


def test_cuda_moe_torch_route_rows_is_the_stable_sort():
    """``route_rows`` (torch kernels): each sorted row's token, each assignment's sorted row and the group ends
    of a stable sort, checked against a direct construction."""
    from omni.platforms.cuda.moe import TorchKernels

    ids = torch.tensor([[2, 0], [0, 3], [2, 1], [0, 2]])
    token_R, inverse_R, ends_E = TorchKernels().route_rows(ids, 5)
    flat = ids.flatten().tolist()
    order = sorted(range(len(flat)), key=lambda r: (flat[r], r))  # stable: equal experts keep their order
    assert token_R.tolist() == [r // 2 for r in order]
    assert [order[p] for p in inverse_R.tolist()] == list(range(len(flat)))
    assert ends_E.dtype == torch.int32 and ends_E.tolist() == [3, 4, 7, 8, 8]
