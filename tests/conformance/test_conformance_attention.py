"""Resolved attention kernels against an oracle, over the spec grid, per platform.

The grid covers fp32/bf16/fp16, head dims 64/128, GQA 1 and 4, varlen batches
with unequal and mismatched q/k lengths ([1, 17, 64]; q shorter than k;
equal lengths), masks none / causal (bottom-right) / dense, and paged KV with
page sizes 16 and 256. A second, smaller grid asks the CUDA platform for each
backend by name (fa3, varlen, sdpa, flex); a backend that refuses the spec is
skipped with its reason.
"""
from __future__ import annotations

import pytest
import torch

from conformance_cases import (NOT_CUDA_ON_ROCM, RESOLVED, ROCM_BUILD, TOL, attention_grid, attention_spec, device_of,
                               get_platform, make_attention_case, oracles)

GRID = list(attention_grid())


def _check(impl, spec, batch, platform_name, seed=0):
    q, k, v, meta = make_attention_case(spec, batch, device_of(platform_name), seed)
    out = impl(q, k, v, meta)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    expected = oracles(platform_name)[0](spec, q, k, v, meta)
    torch.testing.assert_close(out.float().cpu(), expected.float(), **TOL[spec.dtype])
    assert torch.equal(impl(q, k, v, meta), out), "same inputs must give bitwise identical outputs"


@pytest.mark.parametrize("dtype,head_dim,gqa,mask,page,batch", GRID,
                         ids=[f"{d}-h{h}-gqa{g}-{m}-page{p}-{b}" for d, h, g, m, p, b in GRID])
def test_attention_matches_oracle(platform_name, dtype, head_dim, gqa, mask, page, batch):
    spec = attention_spec(dtype, head_dim, gqa, mask, page)
    impl = get_platform(platform_name).attention(spec)
    RESOLVED[(platform_name, "attention", dtype, mask, f"page{page}", "auto")].add(impl.name)
    _check(impl, spec, batch, platform_name)


BACKEND_GRID = [
    (backend, dtype, hd, gqa, mask, page, batch)
    for backend in ("fa3", "varlen", "sdpa")
    for dtype in ("bf16", "fp16")
    for hd in (64, 128)
    for gqa in (1, 4)
    for mask, page in (("none", 0), ("causal", 0), ("causal", 256), ("dense", 0))
    for batch in ("mixed", "q<k")
] + [("flex", "bf16", 64, 4, "dense", 0, "mixed"), ("flex", "bf16", 64, 1, "causal", 0, "q<k")]


@pytest.mark.gpu
@pytest.mark.skipif(ROCM_BUILD, reason=NOT_CUDA_ON_ROCM)
@pytest.mark.parametrize("backend,dtype,head_dim,gqa,mask,page,batch", BACKEND_GRID,
                         ids=["-".join(map(str, c)) for c in BACKEND_GRID])
def test_cuda_named_backend(backend, dtype, head_dim, gqa, mask, page, batch):
    if not torch.cuda.is_available():
        pytest.skip("cuda: no CUDA device here")
    from omni.platforms.cuda.plugin import plugin

    spec = attention_spec(dtype, head_dim, gqa, mask, page, backend=backend)
    reasons: list[str] = []
    impl = plugin.omni_attention_impl(spec=spec, reject=reasons.append)
    if impl is None:
        assert reasons, "a refusal must carry a reason"
        pytest.skip("; ".join(reasons))
    RESOLVED[("cuda", "attention", dtype, mask, f"page{page}", backend)].add(impl.name)
    _check(impl, spec, batch, "cuda")


class _Broken:
    """Kernels with classic bugs; the oracle must reject each, or the suite proves nothing."""

    def __init__(self, spec, bug):
        from omni.reference import sdpa_TNH

        self.spec, self.bug, self.sdpa = spec, bug, sdpa_TNH

    def __call__(self, q, k, v, meta):
        cq, ck = meta.cu_seqlens_q_host, meta.cu_seqlens_k_host
        out = torch.zeros_like(q)
        for b in range(len(cq) - 1):
            qb, kb, vb = q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
            if self.bug == "gqa-modulo":  # query head n reads kv head n % K instead of n // (N // K)
                idx = torch.arange(q.shape[1]) % k.shape[1]
                kb, vb = kb[:, idx], vb[:, idx]
            mask = torch.ones(qb.shape[0], kb.shape[0], dtype=torch.bool).tril()  # top-left causal
            out[cq[b]:cq[b + 1]] = self.sdpa(qb, kb, vb, mask, 1 / self.spec.head_dim ** 0.5)
        return out


@pytest.mark.parametrize("bug", ["top-left-causal", "gqa-modulo"])
def test_oracle_rejects_known_bugs(bug):
    spec = attention_spec("fp32", 64, 4, "causal", 0)
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu")
    if bug == "gqa-modulo":  # make only the head mapping wrong: equal lengths, bottom-right == top-left
        q, k, v, meta = make_attention_case(spec, "mixed", "cpu")
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_Broken(spec, bug)(q, k, v, meta), oracles("cpu")[0](spec, q, k, v, meta).float(),
                                   **TOL[spec.dtype])
