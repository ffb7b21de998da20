"""``bench/fp8_attention_error.py``: its attention is the reference platform's, and its findings hold on a small
case (the CPU analysis behind BENCHMARKS.md "Forty-sixth session", issue 17 item 3)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from omni.reference import ReferenceAttention
from omni.specs import AttentionSpec, VarlenMeta

BENCH = Path(__file__).resolve().parents[1] / "bench"
spec = importlib.util.spec_from_file_location("fp8_attention_error", BENCH / "fp8_attention_error.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_its_fp8_scheme_with_exact_probabilities_is_the_reference_platforms_fp8_attention():
    q, k, v = tool.inputs(queries=96, prefix=40, seed=1)
    cq, ck = (0, q.shape[0]), (0, k.shape[0])
    meta = VarlenMeta(cu_seqlens_q_B1=torch.tensor(cq, dtype=torch.int32),
                      cu_seqlens_k_B1=torch.tensor(ck, dtype=torch.int32), max_seqlen_q=cq[1], max_seqlen_k=ck[1],
                      cu_seqlens_q_host=cq, cu_seqlens_k_host=ck)
    ref = ReferenceAttention(AttentionSpec(num_heads=tool.N, num_kv_heads=tool.K, head_dim=tool.H,
                                           dtype=torch.float32, fp8=True))
    got = tool.schemes(q, k, v)["qkv_fp8_exact_p"]()
    want = ref(q, k, v, meta)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(tool.attention(q, k, v), want, rtol=1e-3, atol=1e-3)  # the rounding shows


def test_finer_fp8_scales_do_not_help_and_smoothed_int8_qk_does():
    e = tool.errors(queries=256, prefix=64, seed=0)
    assert e["bf16_output_rounding"] < e["qk_int8_smoothed"] < e["qk_fp8"] < e["fa3_fp8"]
    assert abs(e["fa3_fp8_per_head"] - e["fa3_fp8"]) < 0.05 * e["fa3_fp8"]  # e4m3's mantissa, not its range
    assert e["qkv_fp8_exact_p"] < e["fa3_fp8"]  # FA3's unscaled e4m3 probabilities add their own error
