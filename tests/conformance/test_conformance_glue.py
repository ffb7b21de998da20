"""Fused glue (``omni_glue_impl``) against oracles written here, per platform under test.

The oracles are independent of ``omni.reference_glue``: float64 math with the
documented roundings spelled out (normalised value rounded to the activation
dtype, then weighted and rounded; RoPE rounded before its QK-norm), an
explicit pair-rotation loop for RoPE and a sort-based top-k. A fused kernel
keeps fp32 between steps, so it may differ from the oracle by one rounding
of the activation dtype; quantized outputs are compared after dequantizing.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conformance_cases import DTYPES, FP8_MAX, RESOLVED, device_of, get_platform
from omni import quant
from omni.specs import GemmSpec, GlueSpec, RowQuantized

SHAPES = {"small": (64, 16, 4, 2, 8, 2), "released-head": (256, 128, 8, 2, 64, 8)}  # D, H, N, K, E, topk
ULP = {torch.float32: 3e-5, torch.bfloat16: 1.6e-2}  # one rounding of the dtype (fp32: and of its fp32 tables)


def _spec(shape: str, dtype: torch.dtype) -> GlueSpec:
    D, H, _, _, _, k = SHAPES[shape]
    return GlueSpec(hidden=D, head_dim=H, eps=1e-5, dtype=dtype, topk=k)


def _rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def naive_rms(x: torch.Tensor, w: torch.Tensor, eps: float, dtype) -> torch.Tensor:
    x64 = x.double()
    n = (x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)).to(dtype).double()
    return (w.double() * n).to(dtype)


def naive_rope(x_TNH: torch.Tensor, angle_TF: torch.Tensor, dtype) -> torch.Tensor:
    """Dims i and i + H/2 rotate as a pair by angle f_i (the tables repeat the angles)."""
    out = x_TNH.double().clone()
    F = angle_TF.shape[1]
    for i in range(F):
        a, b = x_TNH[..., i].double(), x_TNH[..., i + F].double()
        c, s = angle_TF[:, i, None].cos(), angle_TF[:, i, None].sin()
        out[..., i], out[..., i + F] = a * c - b * s, b * c + a * s
    return out.to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, dtype, what: str) -> None:
    got, want = got.double().cpu(), want.double().cpu()
    err = ((got - want).abs() / (want.abs() + 1e-3)).max().item()
    assert err <= 2 * ULP[dtype], f"{what}: relative error {err:.3g} > {2 * ULP[dtype]:.3g}"


def _dequant(r: RowQuantized) -> torch.Tensor:
    return r.q_TI.double().cpu() * r.scale_T1.double().cpu()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_norms_match_the_oracle(platform_name, dtype, shape):
    dt, dev = DTYPES[dtype], device_of(platform_name)
    spec = _spec(shape, dt)
    glue = get_platform(platform_name).glue(spec)
    RESOLVED[(platform_name, "glue", dtype, shape)].add(glue.name)
    x, d = _rand(37, spec.hidden, seed=1, scale=3).to(dt), _rand(37, spec.hidden, seed=2).to(dt)
    w = (1 + _rand(spec.hidden, seed=3, scale=0.2)).to(dt)
    _close(glue.rms_norm(x.to(dev), w.to(dev), False), naive_rms(x, w, spec.eps, dt), dt, "rms_norm")
    h, rows = glue.add_rms_norm(x.to(dev), d.to(dev), w.to(dev), True)
    h_want = (x.double() + d.double()).to(dt)
    _close(h, h_want, dt, "add_rms_norm: h")
    y_want = naive_rms(h_want, w, spec.eps, dt)
    _close(rows.x_TI, y_want, dt, "add_rms_norm: y")
    scale_want = y_want.double().abs().amax(-1, keepdim=True) / FP8_MAX
    assert torch.allclose(rows.scale_T1.double().cpu(), scale_want, rtol=2 * ULP[dt])
    err = (_dequant(rows) - y_want.double()).abs() / scale_want
    assert err.max() <= 16 * (1 + 1e-3), "e4m3 rows are off by more than half an e4m3 step at the top of the range"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_rope_qk_norm_matches_the_oracle(platform_name, dtype, shape):
    dt, dev = DTYPES[dtype], device_of(platform_name)
    D, H, N, K, _, _ = SHAPES[shape]
    spec = _spec(shape, dt)
    glue = get_platform(platform_name).glue(spec)
    T = 29
    qkv = _rand(T, (N + 2 * K) * H, seed=4).to(dt)
    angle_TF = _rand(T, H // 2, seed=5, scale=4.0)
    cos, sin = torch.cat([angle_TF.cos()] * 2, -1).float(), torch.cat([angle_TF.sin()] * 2, -1).float()
    wq, wk = (1 + _rand(H, seed=6, scale=0.2)).to(dt), (1 + _rand(H, seed=7, scale=0.2)).to(dt)
    q, k, v = glue.rope_qk_norm(qkv.to(dev), cos.to(dev), sin.to(dev), wq.to(dev), wk.to(dev), (N, K))
    groups = qkv.view(T, K, N // K + 2, H)
    q_want = naive_rms(naive_rope(groups[:, :, :-2].reshape(T, N, H), angle_TF, dt), wq, spec.eps, dt)
    k_want = naive_rms(naive_rope(groups[:, :, -2], angle_TF, dt), wk, spec.eps, dt)
    _close(q, q_want, dt, "q")
    _close(k, k_want, dt, "k")
    assert torch.equal(v.cpu(), groups[:, :, -1]), "v must pass through untouched"


@pytest.mark.parametrize("quantize", [False, True])
def test_swiglu_gates_with_the_second_half(platform_name, quantize):
    dt, dev = torch.bfloat16, device_of(platform_name)
    glue = get_platform(platform_name).glue(_spec("small", dt))
    h = _rand(19, 2 * 48, seed=8, scale=2).to(dt)
    x1, x2 = h.double().chunk(2, -1)
    want = (x1 * x2 / (1 + torch.exp(-x2))).to(dt)
    out = glue.swiglu(h.to(dev), quantize)
    got = _dequant(out) if quantize else out
    bound = 1 / 8 if quantize else 2 * ULP[dt]  # e4m3 keeps 3 mantissa bits
    err = ((got.double().cpu() - want.double()).abs() / (want.double().abs().amax(-1, keepdim=True))).max()
    assert err <= bound, f"swiglu: error {err:.3g}"


@pytest.mark.parametrize("always_on", [0, 1])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_route_is_softmax_topk_renormalised(platform_name, shape, always_on):
    """Then ``always_on`` columns: ids E, E + 1, ... with weight 1 (the fused shared expert)."""
    _, _, _, _, E, k = SHAPES[shape]
    dev = device_of(platform_name)
    glue = get_platform(platform_name).glue(dataclasses.replace(_spec(shape, torch.bfloat16), always_on=always_on))
    logits = _rand(41, E, seed=9, scale=3).float()
    w, ids = glue.route(logits.to(dev))
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (41, k + always_on)
    assert ids[:, k:].tolist() == [list(range(E, E + always_on))] * 41 and bool((w[:, k:] == 1).all())
    w, ids = w[:, :k], ids[:, :k]
    p = torch.softmax(logits.double(), -1)
    order = p.argsort(-1, descending=True)[:, :k]
    assert torch.equal(ids.cpu(), order), "top-k experts (descending) differ"
    want = p.gather(1, order)
    want = want / want.sum(-1, keepdim=True)
    assert torch.allclose(w.double().cpu(), want, rtol=1e-5, atol=1e-7)


def test_no_tokens_is_fine(platform_name):
    """A sequence-parallel rank may hold no tokens: every method returns empty results."""
    D, H, N, K, E, k = SHAPES["small"]
    dev = device_of(platform_name)
    glue = get_platform(platform_name).glue(_spec("small", torch.bfloat16))
    x = torch.zeros(0, D, dtype=torch.bfloat16, device=dev)
    w = torch.ones(D, dtype=torch.bfloat16, device=dev)
    assert glue.rms_norm(x, w, True).q_TI.shape == (0, D)
    assert glue.add_rms_norm(x, x, w, False)[1].shape == (0, D)
    qkv = torch.zeros(0, (N + 2 * K) * H, dtype=torch.bfloat16, device=dev)
    tab = torch.zeros(0, H, device=dev)
    assert [t.shape for t in glue.rope_qk_norm(qkv, tab, tab, w[:H], w[:H], (N, K))] == [(0, N, H), (0, K, H),
                                                                                         (0, K, H)]
    assert glue.route(torch.zeros(0, E, device=dev))[1].shape == (0, k)


def test_store_gather_kv_stores_then_gathers(platform_name):
    """``store_gather_kv`` (where a glue has it): the pool holds the new K/V at their slots afterwards and the
    table is the pool's rows after the store, bit for bit: new rows (also repeated), older rows, padding."""
    from omni.kv_pool import fresh_rows

    glue = get_platform(platform_name).glue(_spec("small", torch.bfloat16))
    if not hasattr(glue, "store_gather_kv"):
        pytest.skip(f"{glue.name} has no store_gather_kv (the KV pool stores and gathers with torch ops)")
    dev, K, H = device_of(platform_name), 2, 64
    kp, vp = (_rand(40, K, H, seed=s).to(torch.bfloat16).to(dev) for s in (20, 21))
    k, v = (_rand(6, K, H, seed=s).to(torch.bfloat16).to(dev) for s in (22, 23))
    write = torch.tensor([7, 8, 9, 30, 31, 3])
    gather = torch.tensor([0, 1, 2, 7, 8, 9, 3, 30, 31, 5, 0, 0, 9])  # older, new, new again, padding (slot 0)
    want_kp, want_vp = kp.clone(), vp.clone()
    want_kp[write.to(dev)], want_vp[write.to(dev)] = k, v
    fresh = fresh_rows(write, gather)
    assert fresh.tolist() == [-1, -1, -1, 0, 1, 2, 5, 3, 4, -1, -1, -1, 2]
    ko, vo = glue.store_gather_kv(kp, vp, k, v, write.to(dev), gather.to(dev), fresh.to(dev))
    assert torch.equal(kp, want_kp) and torch.equal(vp, want_vp)
    assert torch.equal(ko, want_kp[gather.to(dev)]) and torch.equal(vo, want_vp[gather.to(dev)])


def test_an_fp8_row_linear_takes_quantized_rows_as_they_are(platform_name):
    """``accepts_row_quantized``: the product of pre-quantized rows equals quantizing inside the linear."""
    dev = device_of(platform_name)
    spec = GemmSpec(in_features=64, out_features=32, dtype=torch.bfloat16, quant="fp8_row")
    lin = get_platform(platform_name).linear(spec)
    assert getattr(lin, "accepts_row_quantized", False), f"{lin.name} does not take RowQuantized rows"
    x, w = _rand(9, 64, seed=10).to(torch.bfloat16).to(dev), _rand(32, 64, seed=11).to(torch.bfloat16).to(dev)
    pw = lin.prepare_weight(w)
    q, s = quant.quantize_fp8(x, per_row=True)
    assert torch.equal(lin(RowQuantized(q, s, x), pw), lin(x, pw))


def test_a_triton_demand_is_refused_by_the_reference_naming_the_field():
    from omni.platform_manager import NoImplementationError, select

    with pytest.raises(NoImplementationError, match="memory_bound=triton"):
        select("cpu").glue(GlueSpec(hidden=8, head_dim=4, eps=1e-6, dtype=torch.float32, memory_bound="triton"))


def test_the_reference_glue_is_the_models_math():
    """The golden-exact model code path: the reference glue equals the official RMSNorm formula (fp32, 1e-6)."""
    from omni.reference_glue import ReferenceGlue

    g = ReferenceGlue(GlueSpec(hidden=32, head_dim=8, eps=1e-6, dtype=torch.float32, topk=2))
    x, w = _rand(5, 32, seed=12).float(), (1 + _rand(32, seed=13, scale=0.1)).float()
    official = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(g.rms_norm(x, w, False), official, rtol=1e-6, atol=1e-6)
    assert math.isclose(float(g.route(torch.tensor([[0.0, 1.0, 2.0]]))[0].sum()), 1.0, rel_tol=1e-6)
