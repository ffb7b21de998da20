"""CUDA-graph capture and replay of one attention + linear step through the cuda platform.

The step is what a denoising step does per layer: packed varlen attention
(optionally over a paged pool) followed by a projection. It is captured once
with static buffers; new inputs and new page lengths are copied in place and
the replay must match an eager run on the same buffers. A capture that hid a
host sync would fail to record at all.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from omni.specs import AttentionSpec, CaptureSpec, GemmSpec, VarlenMeta

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

N, K, H = 8, 2, 128
LQ, LK = [64, 17, 128], [64, 100, 256]


def _cu(lengths):
    return tuple(itertools.accumulate(lengths, initial=0))


def _static_inputs(page: int, g: torch.Generator):
    cu_q, cu_k = _cu(LQ), _cu(LK)
    q = torch.randn(cu_q[-1], N, H, generator=g).bfloat16().cuda()
    extra = {}
    if page:
        pages = [-(-n // page) for n in LK]
        table = torch.arange(sum(pages)).flip(0)  # pages in reverse order: addressing must use the table
        rows = torch.split(table, pages)
        bt = torch.zeros(len(LK), max(pages), dtype=torch.int32)
        for b, r in enumerate(rows):
            bt[b, :len(r)] = r
        k = torch.randn(sum(pages), page, K, H, generator=g).bfloat16().cuda()
        v = torch.randn(sum(pages), page, K, H, generator=g).bfloat16().cuda()
        extra = {"block_table_BP": bt.cuda(), "seqused_k_B": torch.tensor(LK, dtype=torch.int32).cuda()}
    else:
        k = torch.randn(cu_k[-1], K, H, generator=g).bfloat16().cuda()
        v = torch.randn(cu_k[-1], K, H, generator=g).bfloat16().cuda()
    meta = VarlenMeta(cu_seqlens_q_B1=torch.tensor(cu_q, dtype=torch.int32).cuda(),
                      cu_seqlens_k_B1=torch.tensor(cu_k, dtype=torch.int32).cuda(),
                      max_seqlen_q=max(LQ), max_seqlen_k=max(LK), cu_seqlens_q_host=cu_q, cu_seqlens_k_host=cu_k,
                      **extra)
    return q, k, v, meta


@pytest.mark.parametrize("quant", ["none", "fp8_row"])
@pytest.mark.parametrize("backend,page", [("auto", 0), ("sdpa", 0), ("auto", 256), ("sdpa", 16)])
def test_capture_replay_attention_linear_step(platform, backend, page, quant, capsys):
    spec = AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16, mask="causal",
                         paged=bool(page), page_size=page, backend=backend, capturable=True)
    attn = platform.attention(spec)
    lin = platform.linear(GemmSpec(in_features=N * H, out_features=N * H, dtype=torch.bfloat16, quant=quant, bias=True))
    assert not attn.name.startswith("reference") and not lin.name.startswith("reference")
    g = torch.Generator().manual_seed(0)
    q, k, v, meta = _static_inputs(page, g)
    w = lin.prepare_weight((torch.randn(N * H, N * H, generator=g) / (N * H) ** 0.5).bfloat16().cuda())
    b = torch.randn(N * H, generator=g).bfloat16().cuda()

    def step():
        return lin(attn(q, k, v, meta).reshape(q.shape[0], N * H), w, b)

    runner = platform.graph_runner(CaptureSpec(device_type="cuda", name=f"step[{backend},{page},{quant}]"))
    static_out = runner.capture(step)
    for t in (q, k, v):  # new step: new activations in the same buffers
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    if page:  # and shorter keys for the first sequence, read from device memory at replay
        meta.seqused_k_B[0] = 33
    runner.replay()
    torch.cuda.synchronize()
    eager = step()
    with capsys.disabled():
        print(f"\n[graph] {attn.name} + {lin.name} page={page}: replay vs eager max |diff| "
              f"{(static_out.float() - eager.float()).abs().max().item():.3e}")
    torch.testing.assert_close(static_out, eager, atol=1e-2, rtol=1e-2)
