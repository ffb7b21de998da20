"""``attention.fp8`` on the H200: FA3's e4m3 forward against its bf16 forward and the reference's semantics.

Inputs as the model feeds them: queries and keys after the QK-norm (RMS 1
per head), two sequences of an image block (4097 queries) attending to a
prefix plus themselves, GQA 32/8 heads of 128. The gate (docs/quality.md)
is the relative L2 error against the bf16 kernel.
"""
from __future__ import annotations

import pytest
import torch

from omni.specs import AttentionSpec, VarlenMeta

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

GATE = 0.06
N, K, H, LQ, LK = 32, 8, 128, [4097, 4097], [4397, 4500]


def _meta():
    cq, ck = [0, LQ[0], sum(LQ)], [0, LK[0], sum(LK)]
    t = lambda c: torch.tensor(c, dtype=torch.int32, device="cuda")  # noqa: E731
    return VarlenMeta(cu_seqlens_q_B1=t(cq), cu_seqlens_k_B1=t(ck), max_seqlen_q=max(LQ), max_seqlen_k=max(LK),
                      cu_seqlens_q_host=tuple(cq), cu_seqlens_k_host=tuple(ck))


def test_fa3_fp8_attention_within_the_gate():
    from omni import platform_manager
    from omni.platform_manager import NoImplementationError

    plat = platform_manager.select("cuda")
    plat.device_services(0)
    spec = AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16, fp8=True)
    try:
        fp8 = plat.attention(spec)
    except NoImplementationError as e:
        pytest.skip(f"no fp8 attention here: {e}")
    if fp8.name.startswith("reference"):  # the cuda platform refused (no FA3 here): the CPU-semantics oracle answered
        pytest.skip(f"no device fp8 attention here (resolved {fp8.name}); install FA3 to run this gate")
    assert "fp8" in fp8.name
    bf16 = plat.attention(AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16))
    g = torch.Generator(device="cuda").manual_seed(0)
    norm = lambda x: torch.nn.functional.rms_norm(x, (H,)).bfloat16()  # noqa: E731
    q = norm(torch.randn(sum(LQ), N, H, device="cuda", generator=g) * 3)
    k = norm(torch.randn(sum(LK), K, H, device="cuda", generator=g) * 3)
    v = torch.randn(sum(LK), K, H, device="cuda", generator=g).bfloat16()
    meta = _meta()
    want, got = bf16(q, k, v, meta).float(), fp8(q, k, v, meta)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    err = ((got.float() - want).norm() / want.norm()).item()
    from omni.reference import ReferenceAttention

    ref = ReferenceAttention(AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.float32, fp8=True))
    err_ref = ((got.float() - ref(q.float(), k.float(), v.float(), meta).float()).norm() / want.norm()).item()
    print(f"[fp8 attention] {fp8.name}: vs bf16 {err:.4f} (gate {GATE}), vs reference fp8 semantics {err_ref:.4f}")
    assert 1e-4 < err <= GATE and err_ref <= GATE
