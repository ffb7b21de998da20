"""FA3 through its registered op against FA3 through its Python wrappers, on the GPU.

Both routes launch the same kernel with the same arguments, so outputs must be
bit-identical: varlen without and with the causal mask, the paged call, the
e4m3 call. The image step's call, unpacked (``fa3_pack_gqa``), answers as the
packed call does against fp32 attention. A fresh process then resolves attention as a build does, calls it
once, and must not have imported ``torch._dynamo`` (the wrappers' custom op
does on first use: seconds of the warm-up, BENCHMARKS.md).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from omni.specs import AttentionSpec, VarlenMeta

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

N, K, H, PAGE = 32, 8, 128, 256
LQ, LK = [4097, 1000], [4397, 1500]


@pytest.fixture(scope="module")
def fa3():
    from omni.platforms.cuda.capabilities import detect_caps, load_fa3

    caps = detect_caps(0)
    if caps.fa3_module is None or caps.sm != (9, 0):
        pytest.skip(f"no FA3 here (module {caps.fa3_module}, sm {caps.sm})")
    loaded = load_fa3(caps.fa3_module)
    if isinstance(loaded, str) or loaded.fwd is None:
        pytest.skip(f"FA3 without a registered op matching our keywords: {loaded}")
    return loaded


def _case(paged: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g).bfloat16()  # noqa: E731
    cq, ck = [0, LQ[0], sum(LQ)], [0, LK[0], sum(LK)]
    t = lambda c: torch.tensor(c, dtype=torch.int32, device="cuda")  # noqa: E731
    meta = dict(cu_seqlens_q_B1=t(cq), cu_seqlens_k_B1=t(ck), max_seqlen_q=max(LQ), max_seqlen_k=max(LK),
                cu_seqlens_q_host=tuple(cq), cu_seqlens_k_host=tuple(ck))
    q = rand(sum(LQ), N, H)
    if not paged:
        return q, rand(sum(LK), K, H), rand(sum(LK), K, H), VarlenMeta(**meta)
    pages = [-(-n // PAGE) for n in LK]
    order = torch.randperm(sum(pages) + 2, device="cuda", generator=g).int()
    table = torch.zeros(len(LK), max(pages), dtype=torch.int32, device="cuda")
    table[0, :pages[0]], table[1, :pages[1]] = order[:pages[0]], order[pages[0]:sum(pages)]
    pool = lambda: rand(sum(pages) + 2, PAGE, K, H)  # noqa: E731
    return q, pool(), pool(), VarlenMeta(**meta, block_table_BP=table, seqused_k_B=t(LK))


@pytest.mark.parametrize("mask,paged,fp8", [("none", False, False), ("causal", False, False),
                                            ("causal", True, False), ("causal", False, True)],
                         ids=["varlen", "varlen-causal", "paged-causal", "fp8-causal"])
def test_the_op_and_the_wrappers_give_the_same_bits(fa3, mask, paged, fp8):
    from omni.platforms.cuda.attention import Fa3Attention

    spec = AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16, mask=mask, paged=paged,
                         page_size=PAGE if paged else 0, fp8=fp8)
    op, wrappers = Fa3Attention(spec, fa3), Fa3Attention(spec, dataclasses.replace(fa3, fwd=None))
    assert op.name.endswith(", op)") and not wrappers.name.endswith(", op)")
    q, k, v, meta = _case(paged)
    a, b = op(q, k, v, meta), wrappers(q, k, v, meta)
    assert a.shape == q.shape and a.dtype == torch.bfloat16 and a.abs().sum() > 0
    assert torch.equal(a, b)


def _reference(q, k, v, meta) -> torch.Tensor:
    """fp32 attention of each packed sequence (no mask, GQA by repeating the KV heads)."""
    out, cq, ck = [], meta.cu_seqlens_q_host, meta.cu_seqlens_k_host
    for i in range(len(cq) - 1):
        qs, ks, vs = (x.float().transpose(0, 1) for x in (q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]))
        ks, vs = (x.repeat_interleave(N // K, dim=0) for x in (ks, vs))
        out.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
    return torch.cat(out)


def test_unpacked_query_heads_answer_as_packed_ones(fa3):
    """The image step's call (4097 queries a row) is not packed (``fa3_pack_gqa``); forced packing answers within
    the same distance of fp32 attention: only the tiling differs."""
    from omni.platforms.cuda.attention import Fa3Attention

    spec = AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16)
    impl = Fa3Attention(spec, fa3)
    q, k, v, meta = _case(paged=False)
    assert impl.pack_gqa(meta.max_seqlen_q) is False
    unpacked = impl(q, k, v, meta)
    impl.pack_gqa = lambda _: True  # FA3's own choice for every varlen call
    packed = impl(q, k, v, meta)
    want = _reference(q, k, v, meta)
    errs = [float((x.float() - want).norm() / want.norm()) for x in (unpacked, packed)]
    print("relative error vs fp32: unpacked %.2e, packed %.2e" % tuple(errs))
    assert max(errs) < 5e-3 and errs[0] < 1.2 * errs[1] + 1e-4


def test_a_build_first_attention_call_imports_no_dynamo(fa3):
    code = """
import sys, time, torch
from omni import platform_manager
from omni.specs import AttentionSpec, VarlenMeta
plat = platform_manager.select("cuda"); plat.device_services(0)
impl = plat.attention(AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, mask="causal"))
q = torch.randn(300, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(300, 8, 128, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
meta = VarlenMeta(cu_seqlens_q_B1=cu, cu_seqlens_k_B1=cu, max_seqlen_q=300, max_seqlen_k=300,
                  cu_seqlens_q_host=(0, 300), cu_seqlens_k_host=(0, 300))
t = time.perf_counter(); impl(q, k, k, meta); torch.cuda.synchronize()
print(impl.name, "first call", round(time.perf_counter() - t, 3), "s, torch._dynamo imported:",
      "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    assert ", op)" in out.stdout and "torch._dynamo imported: False" in out.stdout, out.stdout
