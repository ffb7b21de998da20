"""``bench/fast_profile.gemm_rates``: the expert GEMMs' and the dense GEMMs' rates inside the step, from a profile's
kernel rows (issue 17's item 2 on the engine's own activations), checked on two recorded H100 profiles
(``bench/results/*_profile_h100_s45_*``): our CUTLASS MoE and the DeepGEMM MoE."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from fast_floor import step_flops  # noqa: E402
from fast_profile import category, gemm_rates  # noqa: E402

RELEASED = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           moe_intermediate_size=[3072], moe_topk=[8], num_experts=64, num_shared_expert=[1])


def recorded(name: str):
    top = json.loads((BENCH / "results" / name).read_text())["kernels_fp8_graph"]["top"]
    return [(r["kernel"], r["ms_per_layer"], r["calls_per_layer"]) for r in top]


@pytest.mark.parametrize("name,grouped_marker", [
    ("bench_fast_auto_profile_h100_s45_2026-12-06.json", "GroupProblemShape"),
    ("bench_fast_deepgemm_profile_h100_s45_2026-12-06.json", "deep_gemm")])
def test_gemm_rates_split_the_steps_gemms_into_expert_and_dense(name, grouped_marker):
    rows = recorded(name)
    fl = step_flops(RELEASED, 8194, [])
    got = gemm_rates(rows, fl["routed"], fl["dense"])
    grouped_ms = sum(ms for n, ms, _ in rows if grouped_marker in n)
    dense_ms = sum(ms for n, ms, _ in rows if category(n) == "gemm" and grouped_marker not in n)
    assert grouped_ms > 0 and dense_ms > 0
    assert got["grouped_ms"] == pytest.approx(grouped_ms) and got["dense_ms"] == pytest.approx(dense_ms)
    assert got["grouped_tflops"] == pytest.approx(fl["routed"] / grouped_ms / 1e9)
    assert got["grouped_over_dense"] == pytest.approx(got["grouped_tflops"] / got["dense_tflops"])
    assert not any("flash" in n.lower() for n, _, _ in rows if category(n) == "gemm")  # attention is its own


def test_gemm_rates_are_empty_without_both_kinds_of_gemm():
    assert gemm_rates([("nvjet_sm90_qqtst_128x128", 1.0, 4), ("_combine_kernel", 0.2, 1)], 1e12, 1e12) == {}
    assert gemm_rates([], 1e12, 1e12) == {}


@pytest.mark.parametrize("profile", ["kernels_fp8_graph", "kernels_fp8"])
def test_recorded_rates_agree_with_their_own_kernel_rows(profile):
    """bench_fast (H200, forty-sixth session) saved ``gemm_rates`` beside its ``top`` rows and its floor's FLOPs;
    recomputed from those rows they agree within the kernels the saved top list leaves out (under 0.2%)."""
    d = json.loads((BENCH / "results" / "bench_fast_h200_s46_2026-12-06.json").read_text())
    fl, k = d["floor"]["flops_per_layer"], d[profile]
    rows = [(r["kernel"], r["ms_per_layer"], r["calls_per_layer"]) for r in k["top"]]
    got = gemm_rates(rows, fl["routed"], fl["dense"])
    for key in ("grouped_tflops", "dense_tflops", "grouped_over_dense"):
        assert got[key] == pytest.approx(k["gemm_rates"][key], rel=2e-3)
    assert 0.9 < got["grouped_over_dense"] < 1.0  # item 2: close to the dense rate, not at it (BENCHMARKS.md)
