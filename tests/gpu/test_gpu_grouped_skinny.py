"""The grouped e4m3 expert GEMM for a decode step's few rows (``platforms/cuda/grouped_skinny_triton.py``).

- the kernel, plain and with the SwiGLU epilogue, at decode group sizes (one-row groups, empty groups, a group
  over one row block, every row in one expert) and at its measured tile, against the fp64 product: every row
  written, no further from fp64 than our CUTLASS 64-row build on the same operands where that builds here;
- which shapes it takes (``fits``) and its tile bound over the (expert, row block) tiles;
- after ``compile_rows`` (the MoE's build) no call of 1-16 tokens at the released shapes compiles a binary;
- the platform's fused MoE puts it in front of the CUTLASS builds for few rows per expert and replays it from a
  CUDA graph on new routing.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from omni import quant
from omni.platforms.cuda.cutlass_grouped import swiglu_pairs
from omni.specs import MoESpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

triton = pytest.importorskip("triton")
E, K, N = 16, 512, 384  # N: 6 tiles of 64
DECODE_COUNTS = ([1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 0, 1], [0] * 15 + [8],
                 [3, 0, 17, 1, 0, 2, 0, 0, 5, 0, 33, 1, 0, 0, 4, 0], [2] * 16)


def _operands(counts, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(sum(counts), K, device="cuda", generator=g).bfloat16()
    w = torch.randn(E, N, K, device="cuda", generator=g).bfloat16()
    xq, xs = quant.quantize_fp8(x, per_row=True)
    pw = quant.prepare_weight(w, "fp8_row")
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    return xq, xs.reshape(-1).float().contiguous(), pw.data, pw.scale.view(E, N).float().contiguous(), offs


def _fp64(xq, xs, wq, ws, offs, swiglu: bool):
    ends = [0, *offs.tolist()]
    y = torch.cat([(xq[a:b].double() * xs[a:b, None].double()) @ (wq[e].double() * ws[e, :, None].double()).T
                   for e, (a, b) in enumerate(zip(ends[:-1], ends[1:]))])
    return swiglu_pairs(y) if swiglu else y


def _rel(y, ref) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def _cutlass_small(swiglu: bool):
    """Our CUTLASS 64-row build, or None where it cannot be built here."""
    from omni.platforms.cuda import cutlass_grouped as cg
    from omni.platforms.cuda.capabilities import detect_caps

    caps = detect_caps(0)
    if caps.cutlass_grouped_refusal:
        return None
    return cg.load(True, caps.nvcc, caps.cutlass_include, swiglu=swiglu, small=True)


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("case", range(len(DECODE_COUNTS)))
def test_against_fp64_and_the_cutlass_small_tile(swiglu, case):
    """The shipped tiles with the exact bound on the groups passed; the 17- and 33-row groups, past the largest
    tile (which ``fits`` says), span two and three row blocks: still the same function."""
    from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8

    counts = DECODE_COUNTS[case]
    kernel = GroupedSkinnyFp8(64, swiglu)
    args = _operands(counts, case)
    assert kernel.fits(args[0], args[2], group_rows=max(counts)) == (max(counts) <= kernel.max_rows)
    cols = N // 2 if swiglu else N
    out = torch.full((sum(counts), cols), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = kernel(*args, out=out, group_rows=max(counts))
    assert y is out and torch.isfinite(y).all()  # every row of every group written, nothing past them
    exact = _fp64(*args, swiglu)
    rel = _rel(y, exact)
    assert rel < 4e-3, rel  # the bf16 output rounding dominates (1.66e-3 at the released shapes)
    cutlass = _cutlass_small(swiglu)
    if cutlass is not None:
        rel_cutlass = _rel(cutlass(*args), exact)
        assert rel <= 1.05 * rel_cutlass + 1e-6, (rel, rel_cutlass)


def test_fits_and_the_tile_bound():
    from omni.platforms.cuda.grouped_skinny_triton import TILES, GroupedSkinnyFp8, tile_bound

    kernel = GroupedSkinnyFp8(16)
    w = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device="cuda")
    rows = lambda r, k=K: torch.empty(r, k, dtype=torch.float8_e4m3fn, device="cuda")  # noqa: E731
    assert kernel.fits(rows(8 * E), w, group_rows=16) and not kernel.fits(rows(8 * E), w, group_rows=17)
    assert not kernel.fits(rows(8 * E), w)  # no bound given: one group may hold all 128 rows
    assert kernel.fits(rows(16), w) and not kernel.fits(rows(0), w)
    assert not kernel.fits(rows(8, K + 64), w, group_rows=1)  # K off the tile
    assert not kernel.fits(rows(8), torch.empty(E, N + 32, K, dtype=torch.float8_e4m3fn, device="cuda"))
    assert not kernel.fits(torch.empty(8, K, dtype=torch.float8_e4m3fn), w)  # host rows
    assert GroupedSkinnyFp8(1000).max_rows == max(limit for limit, _ in TILES[False])  # the measured tiles only
    assert GroupedSkinnyFp8(4).max_rows == 4 and not GroupedSkinnyFp8(4).fits(rows(8), w, group_rows=5)
    assert all(kernel.tile_for(m).block_m >= m for m in range(1, kernel.max_rows + 1))  # a group in one block
    for counts in DECODE_COUNTS:  # the bound covers the real tile count of each split
        tiles = sum(-(-c // 16) for c in counts)
        assert tiles <= tile_bound(sum(counts), E, 16)


def test_the_platform_moe_runs_it_for_few_rows_and_replays_it(platform):
    """fp8_row, fast accumulation, Triton memory-bound kernels, our CUTLASS builds: few rows per expert take the
    Triton kernel in both expert GEMMs; a captured layer replays it on new routing as the eager layer computes."""
    from omni.platforms.cuda.capabilities import detect_caps
    from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8

    if detect_caps(0).cutlass_grouped_refusal:
        pytest.skip("cuda: the CUTLASS grouped build is not available here")
    spec = MoESpec(num_experts=E, topk=4, hidden=K, inner=N // 2, dtype=torch.bfloat16, quant="fp8_row",
                   fast_accum=True, grouped_fp8="cutlass", memory_bound="triton")
    impl = platform.moe(spec)
    assert isinstance(impl.paired.small, GroupedSkinnyFp8) and impl.paired.small.swiglu, impl.name
    assert isinstance(impl.gemm2.kernel.small, GroupedSkinnyFp8) and not impl.gemm2.kernel.small.swiglu
    g = torch.Generator(device="cuda").manual_seed(7)
    w13, w2 = torch.randn(E, N, K, device="cuda", generator=g).bfloat16(), \
        torch.randn(E, K, N // 2, device="cuda", generator=g).bfloat16()
    prepared = impl.prepare_weights(w13, w2)

    def routing(seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(8, K, device="cuda", generator=gen).bfloat16()
        return (x, *torch.rand(8, E, device="cuda", generator=gen).softmax(-1).topk(4, -1))

    x, w, ids = routing(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl(x, w, ids, prepared)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = impl(x, w, ids, prepared)
    for seed in (2, 3):
        new = routing(seed)
        for held, fresh in zip((x, w, ids), new):
            held.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(captured, impl(*new, prepared), atol=0, rtol=0)
    cutlass = platform.moe(dataclasses.replace(spec, skinny_rows=0))  # the CUTLASS builds alone
    assert not isinstance(cutlass.gemm2.kernel.small, GroupedSkinnyFp8)
    y_cutlass = cutlass(x, w, ids, cutlass.prepare_weights(w13, w2))
    assert _rel(captured, y_cutlass.double()) < 0.01  # one function: other summation orders, e4m3 steps apart


COMPILE_THEN_RUN = """
import os, sys
from pathlib import Path
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]  # empty: every compile of this process lands here
import torch
from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8
from omni.platforms.cuda.pdl import Pdl

binaries = lambda: (torch.cuda.synchronize(), sum(1 for _ in Path(sys.argv[1]).rglob("*.cubin")))[1]
E, out = 64, []
for swiglu, (N, K) in ((True, (6144, 4096)), (False, (4096, 3072))):  # the released expert GEMMs
    few = GroupedSkinnyFp8(16, swiglu, pdl=Pdl(int(sys.argv[2])))
    before = binaries()
    calls = few.compile_rows(E)
    built = binaries()
    w, ws = torch.zeros(E, N, K, device="cuda").to(torch.float8_e4m3fn), torch.ones(E, N, device="cuda")
    for R in range(1, 17):
        offs = torch.arange(E, device="cuda").clamp(max=R).to(torch.int32)
        few(torch.zeros(R, K, device="cuda").to(torch.float8_e4m3fn), torch.ones(R, device="cuda"), w, ws, offs,
            group_rows=R)
    out += [calls, built - before, binaries() - built]
print(*out)
"""


@pytest.mark.parametrize("pdl_rows", [0, 512])
def test_after_compile_rows_no_prompt_of_a_few_tokens_compiles_it(tmp_path, pdl_rows):
    """The first 3-word prompt after an image server's warm-up compiled this kernel's two binaries in its prefill
    (0.79-0.91 s, BENCHMARKS.md "Thirty-fourth session"); the build's ``compile_rows`` compiles them first."""
    from omni.platforms.cuda.pdl_triton import HAS_GDC

    run = subprocess.run([sys.executable, "-c", COMPILE_THEN_RUN, str(tmp_path), str(pdl_rows)], capture_output=True,
                         text=True, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    classes = 3 if pdl_rows and HAS_GDC else 1
    assert list(map(int, run.stdout.split())) == [1, classes, 0] * 2


AFTER_A_LONGER_PROMPT = """
import os, sys
from pathlib import Path
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]  # empty: every compile of this process lands here
import torch
from omni import platform_manager
from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8
from omni.specs import MoESpec

platform = platform_manager.select("cuda")
platform.device_services(0)
binaries = lambda: (torch.cuda.synchronize(), sum(1 for _ in Path(sys.argv[1]).rglob("*.cubin")))[1]
E, D, I, k = 64, 512, 256, 8
impl = platform.moe(MoESpec(num_experts=E, topk=k, hidden=D, inner=I, dtype=torch.bfloat16, quant="fp8_row",
                            fast_accum=True, grouped_fp8="cutlass", memory_bound="triton"))
few = isinstance(impl.paired.small, GroupedSkinnyFp8) and isinstance(impl.gemm2.kernel.small, GroupedSkinnyFp8)
g = torch.Generator(device="cuda").manual_seed(0)
prepared = impl.prepare_weights(torch.randn(E, 2 * I, D, device="cuda", generator=g).bfloat16(),
                                torch.randn(E, D, I, device="cuda", generator=g).bfloat16())


def layer(tokens):
    x = torch.randn(tokens, D, device="cuda", generator=g).bfloat16()
    w, ids = torch.rand(tokens, E, device="cuda", generator=g).softmax(-1).topk(k, -1)
    impl(x, w, ids, prepared)


layer(88)  # a warm-up's longer prompt (44 tokens a row, CFG): the MoE's other kernels compile here
warm = binaries()
for tokens in range(1, 17):  # then every prompt of a few tokens
    layer(tokens)
print(int(few), warm, binaries() - warm)
"""


def test_after_the_build_and_a_longer_prompt_no_prompt_of_a_few_tokens_compiles(tmp_path):
    """The platform's MoE as the build resolves it (``moe.compile_at_build``), then one layer of a longer prompt,
    as a warm-up runs: no layer of 1-16 tokens after that compiles a Triton binary. Before the build compiled the
    few-row GEMM, the first 3-word prompt after an image server's warm-up compiled two (BENCHMARKS.md,
    "Thirty-fifth session")."""
    from omni.platforms.cuda.capabilities import detect_caps

    if detect_caps(0).cutlass_grouped_refusal:
        pytest.skip("cuda: the CUTLASS grouped build is not available here")
    run = subprocess.run([sys.executable, "-c", AFTER_A_LONGER_PROMPT, str(tmp_path)], capture_output=True,
                         text=True, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    few, warm, after = map(int, run.stdout.split())
    assert few == 1 and warm > 0
    assert after == 0, f"{after} binaries compiled by prompts of 1-16 tokens after the build and a longer prompt"
