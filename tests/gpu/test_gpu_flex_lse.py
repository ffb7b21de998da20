"""Compiled FlexAttention with the log-sum-exp on the GPU: the kernel ring attention resolves on cuda.

Checked against the fp32 reference (``omni.reference.attention_lse_TNH``) at
the released head layout (32 query / 8 KV heads of 128), and used the way
``omni.parallel.ring`` uses it: two partials over disjoint key sets merged by
their LSE equal attention over all keys.
"""
from __future__ import annotations

import pytest
import torch

from omni.parallel.ring import merge
from omni.reference import attention_lse_TNH
from omni.specs import AttentionSpec, VarlenMeta

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]
T, S, N, K, H = 640, 896, 32, 8, 128


def case(seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(T, N, H, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(S, K, H, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.rand(T, S, device="cuda", generator=g) < 0.6
    mask[:, :64] |= torch.arange(T, device="cuda")[:, None] % 3 == 0  # blocks the block mask keeps whole
    mask[7] = False  # a query that sees no key
    return q, k, v, mask


def meta(mask) -> VarlenMeta:
    cu_q, cu_k = (0, mask.shape[0]), (0, mask.shape[1])
    return VarlenMeta(cu_seqlens_q_B1=torch.tensor(cu_q, dtype=torch.int32, device="cuda"),
                      cu_seqlens_k_B1=torch.tensor(cu_k, dtype=torch.int32, device="cuda"),
                      max_seqlen_q=cu_q[1], max_seqlen_k=cu_k[1], cu_seqlens_q_host=cu_q, cu_seqlens_k_host=cu_k,
                      mask_TS=mask)


@pytest.fixture(scope="module")
def kernel():
    from omni.platform_manager import select

    platform = select("cuda")
    platform.device_services(0)
    impl = platform.attention(AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16,
                                            mask="dense", return_lse=True))
    assert impl.name == "cuda-flex-lse" and impl.returns_lse
    return impl


def test_flex_lse_matches_the_reference(kernel):
    q, k, v, mask = case(1)
    o, lse = kernel(q, k, v, meta(mask))
    o_ref, lse_ref = attention_lse_TNH(q, k, v, mask, H ** -0.5)
    assert torch.isneginf(lse[7]).all() and torch.all(o[7] == 0)
    seen = mask.any(-1)
    torch.testing.assert_close(lse[seen], lse_ref[seen], atol=2e-2, rtol=0)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)


def test_two_partials_merged_by_lse_equal_the_whole(kernel):
    q, k, v, mask = case(2)
    half = S // 2
    o1, l1 = kernel(q, k[:half], v[:half], meta(mask[:, :half].contiguous()))
    o2, l2 = kernel(q, k[half:], v[half:], meta(mask[:, half:].contiguous()))
    o, lse = merge(*merge(None, None, o1, l1), o2, l2)
    o_ref, lse_ref = attention_lse_TNH(q, k, v, mask, H ** -0.5)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    seen = mask.any(-1)
    torch.testing.assert_close(lse[seen], lse_ref[seen], atol=2e-2, rtol=0)
