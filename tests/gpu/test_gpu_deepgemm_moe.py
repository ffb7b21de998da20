"""The cuda platform's MoE on DeepGEMM (``kernels.grouped_fp8: deepgemm``) on an sm90 device, with the real
``deep_gemm`` (the ``cuda-deepgemm`` extra; skipped where it does not import).

- against the float64 oracle of its roundings (per-row e4m3 rows, 128x128 weight blocks), at a decode step's
  token counts and a prefill's, routed at random and with one busy expert and empty ones; every row written
  (its output buffers are not cleared, so a row the kernel skipped would carry garbage);
- no further from the unquantized float64 experts than the platform's row-scaled MoE (our CUTLASS build);
- rows the glue quantized (``RowQuantized``) give the plain rows' result;
- captured into a CUDA graph and replayed on new tokens and routing: the eager call's bits.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
from conformance_cases import naive_block_moe, naive_moe  # noqa: E402

from omni.specs import MoESpec, RowQuantized  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                                 reason="deepgemm: the sm90 kernel")]

deep_gemm = pytest.importorskip("deep_gemm", reason="the cuda-deepgemm extra is not installed")

SPEC = MoESpec(num_experts=16, topk=4, hidden=512, inner=256, dtype=torch.bfloat16, quant="fp8_row",
               fast_accum=True, grouped_fp8="deepgemm")


def operands(T: int, routing: str, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, D, inner = SPEC.num_experts, SPEC.hidden, SPEC.inner
    logits = torch.randn(T, E, device="cuda", generator=g)
    if routing == "busy":  # expert 2 takes every first choice; experts 0, 1 and 9 nothing
        logits[:, 2] += 100.0
        logits[:, (0, 1, 9)] -= 100.0
    w, ids = logits.softmax(-1).topk(SPEC.topk, dim=-1)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * inner, D, device="cuda", generator=g) / D ** 0.5).bfloat16()
    w2 = (torch.randn(E, D, inner, device="cuda", generator=g) / inner ** 0.5).bfloat16()
    return x, w / w.sum(-1, keepdim=True), ids, w13, w2


def rel(y, ref) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def moe(platform):
    impl = platform.moe(SPEC)
    assert "deepgemm" in impl.name, impl.name
    return impl


@pytest.mark.parametrize("T,routing", [(1, "random"), (5, "random"), (300, "random"), (300, "busy"),
                                       (2500, "random")])
def test_deepgemm_moe_matches_the_oracle_of_its_roundings(moe, T, routing):
    x, w, ids, w13, w2 = operands(T, routing, seed=T)
    y = moe(x, w, ids, moe.prepare_weights(w13, w2))
    assert y.shape == x.shape and torch.isfinite(y).all()
    err = rel(y, naive_block_moe(SPEC, x, w, ids, w13, w2))
    assert err <= 3e-2, err  # the conformance bound of fp8 MoEs; the CPU double: 0.014-0.019


def test_deepgemm_moe_is_as_close_to_exact_as_the_row_scaled_moe(platform, moe):
    row_scaled = platform.moe(dataclasses.replace(SPEC, grouped_fp8="auto"))
    x, w, ids, w13, w2 = operands(2000, "random", seed=5)
    exact = naive_moe(dataclasses.replace(SPEC, quant="none", dtype=torch.float32), x.float(), w, ids,
                      w13.float(), w2.float())
    errs = {impl.name: rel(impl(x, w, ids, impl.prepare_weights(w13, w2)), exact) for impl in (moe, row_scaled)}
    print(errs)
    assert errs[moe.name] <= 1.05 * errs[row_scaled.name], errs


def test_rows_the_glue_quantized_give_the_plain_rows_result(moe):
    from omni import quant

    x, w, ids, w13, w2 = operands(300, "random", seed=7)
    prepared = moe.prepare_weights(w13, w2)
    q, s = quant.quantize_fp8(x, per_row=True)
    y_rows = moe(RowQuantized(q, s, x), w, ids, prepared)
    y = moe(x, w, ids, prepared)
    assert rel(y_rows, y.double().cpu()) <= 1e-2  # the same e4m3 rows up to scale roundings of two kernels


@pytest.mark.parametrize("T", [4, 300])
def test_a_captured_call_replays_the_eager_bits(moe, T):
    x, w, ids, w13, w2 = operands(T, "random", seed=11)
    prepared = moe.prepare_weights(w13, w2)
    moe(x, w, ids, prepared)  # compiles DeepGEMM's kernel for these shapes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = moe(x, w, ids, prepared)
    x2, w2_, ids2, _, _ = operands(T, "busy", seed=12)
    x.copy_(x2), w.copy_(w2_), ids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y_static, moe(x, w, ids, prepared), atol=0, rtol=0)
