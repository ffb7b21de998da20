"""The CUDA MoE's counting sort (``route_rows``) and its combine with addends, Triton against torch, on a device.

- ``route_rows``: the same three tensors as the torch path (a stable sort) at the released shapes (8194 tokens,
  top-8 of 64; and a prefill of 600), with an expert left empty, one busy expert, a width that is not a power of two,
  fewer rows than one block, decode steps of 1, 32, 40 and 64 tokens (small and large chunks), the one-launch sort's
  limit (32 assignments) and the per-chunk plan's (8192), one past each, each through every launch plan, and beyond
  the kernel's block limit (where it hands over to the torch sort); replayed from a CUDA graph on new ids;
- ``route_padded`` (the DeepGEMM MoE's layout): the torch definition's tensors, every plan, two alignments; replayed.
- ``compile_routes`` and the dense few-row GEMM's ``compile_rows`` (what the platform runs at build time):
  afterwards no prompt length compiles the sort or that GEMM again (a fresh process with an empty Triton cache
  counts the binaries).
- ``combine`` with zero, one and two addends: within a bf16 rounding of the torch kernels' fp32 sum, and a
  zero addend changes no bit.
"""
from __future__ import annotations

import os
import subprocess
import sys

from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))

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
    from omni.platforms.cuda.route_launch import ONE_BLOCK_ROWS

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


PADDED_CASES = ("released", "busy", "width37", "under-a-block", "beyond-the-block-limit", "decode-one-token",
                "decode-40-tokens", "past-the-chunk-limit")


@pytest.mark.parametrize("plan", [None, "one launch", "chunks", "blocks"])
@pytest.mark.parametrize("case", PADDED_CASES)
def test_route_padded_equals_the_torch_layout(kernels, case, plan):
    """The DeepGEMM MoE's padded sort (``route_padded``, alignment 128 and 16), every launch plan: the torch
    definition's three tensors, bit for bit, and the layout's rules from first principles."""
    from conformance_cases import check_padded_route
    from omni.platforms.cuda.route_launch import ONE_BLOCK_ROWS

    triton_k, torch_k = kernels
    T, k, E, how = CASES[case]
    if plan == "one launch" and T * k > 4 * ONE_BLOCK_ROWS:
        pytest.skip("one program for every row: meant for a decode step's few")
    ids = routed_ids(T, k, E, how)
    for align in (128, 16):
        got, want = triton_k.route_padded(ids, E, align, plan=plan), torch_k.route_padded(ids, E, align)
        for name in ("token_M", "expert_M", "inverse_R"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), f"{case}, align {align}: {name} differs"
        check_padded_route(got, ids, E, align)


def test_route_padded_replays_from_a_graph(kernels):
    triton_k, torch_k = kernels
    T, k, E = 8194, 8, 64
    ids = routed_ids(T, k, E, "topk", seed=1)
    triton_k.route_padded(ids, E, 128)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_k.route_padded(ids, E, 128)
    ids.copy_(routed_ids(T, k, E, "busy", seed=2))  # another layout: the padding's fills are in the graph
    graph.replay()
    want = torch_k.route_padded(ids, E, 128)
    for name in ("token_M", "expert_M", "inverse_R"):
        assert torch.equal(getattr(out, name), getattr(want, name)), name


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


COMPILE_THEN_RUN = """
import os, sys
from pathlib import Path
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]  # empty: every compile of this process lands here
import torch
from omni.platforms.cuda.moe_triton import TritonKernels
from omni.platforms.cuda.pdl import Pdl
from omni.platforms.cuda.route_launch import route_variants

kernels = TritonKernels(Pdl(512))
binaries = lambda: (torch.cuda.synchronize(), sum(1 for _ in Path(sys.argv[1]).rglob("*.cubin")))[1]
sorts = kernels.compile_routes(64, 8)
compiled = binaries()
for tokens in (1, 3, 4, 5, 7, 8, 14, 17, 33, 40, 64, 65, 300, 600, 1000, 1024, 1025, 1500, 4000, 8194, 20000, 32768):
    kernels.route_rows(torch.rand(tokens, 64, device="cuda").topk(8, -1).indices, 64)
routed = binaries()
skinny = kernels.skinny_fp8(64)
calls = skinny.compile_rows(torch.bfloat16)
compiled_gemm = binaries()
w, ws = torch.zeros(6144, 4096, device="cuda").to(torch.float8_e4m3fn), torch.ones(6144, device="cuda")
for m in (1, 2, 5, 16, 17, 20, 31, 32, 33, 40, 63, 64):
    skinny(torch.zeros(m, 4096, device="cuda").to(torch.float8_e4m3fn), torch.ones(m, 1, device="cuda"), w, ws)
print(sorts, len(route_variants(8, kernels.pdl)), compiled, routed, calls, len(skinny.launches()), compiled_gemm,
      binaries())
"""


@pytest.mark.parametrize("workers", ["1", "4"])
def test_after_the_build_time_compiles_no_row_count_compiles_the_sort_or_the_few_row_gemm(tmp_path, workers):
    """The first request of each prompt length class compiled the sort's kernels (a place-kernel tile per power
    of two blocks, each chunk and PDL variant) and the dense few-row GEMM's row class, until the build compiled
    them all up front; one compile at a time or four in parallel (``triton_compile``): either way, nothing
    compiles after the build."""
    env = dict(os.environ, OMNI_COMPILE_WORKERS=workers)
    run = subprocess.run([sys.executable, "-c", COMPILE_THEN_RUN, str(tmp_path)], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    sorts, variants, compiled, routed, calls, launches, compiled_gemm, ran = map(int, run.stdout.split())
    assert sorts == variants and calls == launches and 0 < compiled < compiled_gemm
    assert routed == compiled, f"{routed - compiled} kernels compiled by sorts after compile_routes"
    assert ran == compiled_gemm, f"{ran - compiled_gemm} kernels compiled by GEMMs after compile_rows"
