"""The CUDA MoE's counting sort (``route_rows``) and its combine with addends, Triton against torch, on a device.

- ``route_rows``: the same three tensors as the torch path (a stable sort) at the released shapes (8194 tokens,
  top-8 of 64; and a prefill of 600), with an expert left empty, one busy expert, a width that is not a power of two,
  fewer rows than one block, decode steps of 1, 32, 40 and 64 tokens (small and large chunks), the one-launch sort's
  limit (32 assignments) and the per-chunk plan's (8192), one past each, each through every launch plan, and beyond
  the kernel's block limit (where it hands over to the torch sort); replayed from a CUDA graph on new ids.
- ``combine`` with zero, one and two addends: within a bf16 rounding of the torch kernels' fp32 sum, and a
  zero addend changes no bit.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

triton = pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels():
    from omni.platforms.cuda.moe import TorchKernels
    from omni.platforms.cuda.moe_triton import TritonKernels

    return TritonKernels(), TorchKernels()


def routed_ids(T: int, k: int, E: int, how: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    if how == "topk":  # distinct experts per token, as a router gives
        return torch.rand(T, E, device="cuda", generator=g).topk(k, dim=-1).indices
    if how == "busy":  # expert 3 takes every first choice; expert 0 none
        ids = torch.randint(1, E, (T, k), device="cuda", generator=g)
        ids[:, 0] = 3
        return ids
    raise ValueError(how)


CASES = {"released": (8194, 8, 64, "topk"), "prefill-of-two-prompts": (600, 8, 64, "topk"),
         "busy": (3000, 4, 16, "busy"), "width37": (1500, 6, 37, "topk"),
         "under-a-block": (7, 3, 8, "topk"), "beyond-the-block-limit": (33000, 8, 64, "topk"),
         "decode-one-token": (1, 8, 64, "topk"), "decode-32-tokens": (32, 8, 64, "topk"),
         "decode-40-tokens": (40, 8, 64, "topk"), "decode-64-tokens": (64, 8, 64, "topk"),
         "one-block-limit": (4, 8, 64, "topk"), "past-the-one-block-limit": (5, 8, 64, "topk"),
         "chunk-limit": (1024, 8, 64, "topk"), "past-the-chunk-limit": (1025, 8, 64, "topk")}


@pytest.mark.parametrize("plan", [None, "one launch", "chunks", "blocks"])
@pytest.mark.parametrize("case", CASES)
def test_route_rows_equals_the_stable_sort(kernels, case, plan):
    """Every launch plan (``route_plan``'s choice, and each one forced) gives the torch sort."""
    from omni.platforms.cuda.moe_triton import ONE_BLOCK_ROWS

    triton_k, torch_k = kernels
    T, k, E, how = CASES[case]
    if plan == "one launch" and T * k > 4 * ONE_BLOCK_ROWS:
        pytest.skip("one program for every row: meant for a decode step's few")
    ids = routed_ids(T, k, E, how)
    got, want = triton_k.route_rows(ids, E, plan=plan), torch_k.route_rows(ids, E)
    for name, a, b in zip(("token_R", "inverse_R", "offsets_E"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{case}: {name} differs"
    if how == "busy":
        assert int(got[2][0]) == 0  # the empty expert's group ends where it starts


@pytest.mark.parametrize("T", [8194, 64, 4], ids=["image-step", "decode-step-64", "decode-step-4"])
def test_route_rows_replays_from_a_graph(kernels, T):
    triton_k, torch_k = kernels
    k, E = 8, 64
    ids = routed_ids(T, k, E, "topk", seed=1)
    triton_k.route_rows(ids, E)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_k.route_rows(ids, E)
    ids.copy_(routed_ids(T, k, E, "topk", seed=2))
    graph.replay()
    for a, b in zip(out, torch_k.route_rows(ids, E)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n_addends", [0, 1, 2])
def test_combine_with_addends_matches_the_torch_kernels(kernels, n_addends):
    triton_k, torch_k = kernels
    T, k, E, D = 8194, 8, 64, 4096
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = routed_ids(T, k, E, "topk", seed=3)
    _, inverse_R, _ = torch_k.route_rows(ids, E)
    y = torch.randn(T * k, D, device="cuda", generator=g).bfloat16()
    w = torch.rand(T, k, device="cuda", generator=g)
    adds = tuple(torch.randn(T, D, device="cuda", generator=g).bfloat16() for _ in range(n_addends))
    got = triton_k.combine(y, inverse_R, w, torch.bfloat16, adds)
    want = torch_k.combine(y, inverse_R, w, torch.bfloat16, adds)
    scale = want.float().abs() + sum((a.float().abs() for a in adds), torch.zeros_like(want, dtype=torch.float32))
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * scale + 1e-6).all()  # fp32 sum order: one bf16 ulp apart
    if adds:
        zero = triton_k.combine(y, inverse_R, w, torch.bfloat16, (torch.zeros_like(adds[0]),))
        assert torch.equal(zero, triton_k.combine(y, inverse_R, w, torch.bfloat16))
