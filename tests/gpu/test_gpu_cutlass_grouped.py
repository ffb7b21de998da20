"""Our CUTLASS grouped fp8 kernel on the device: built by the platform, against torch's kernel and fp64.

Needs sm90, nvcc and the nvidia-cutlass headers (the ``cuda`` extra); skipped
where the platform says it cannot build the kernel (the reason is the skip's).
The first run compiles it into OMNI_KERNEL_CACHE (about a minute).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omni import quant
from omni.specs import GroupedGemmSpec, MoESpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

E, K, N = 8, 512, 384
COUNTS = [300, 0, 129, 1, 640, 0, 77, 256]  # empty groups, a one-row group, partial tiles


@pytest.fixture(scope="module")
def platform():
    from omni import platform_manager
    from omni.platforms.cuda.capabilities import detect_caps

    p = platform_manager.select("cuda")
    p.device_services(0)
    reason = detect_caps(0).cutlass_grouped_refusal
    if reason:
        pytest.skip(f"cuda: {reason}")
    return p


def _operands(seed: int = 0, n: int = N, counts=COUNTS):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(sum(counts), K, device="cuda", generator=g).bfloat16()
    w = torch.randn(E, n, K, device="cuda", generator=g).bfloat16()
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    return x, w, offs


def fp64_product(xq, xs, pw, offs):
    """The scaled product of each expert group in fp64 (e4m3 rows and weights with their row scales)."""
    ends = offs.tolist()
    return torch.cat([(xq[a:b].double() * xs[a:b].double()) @ (pw.data[e].double() * pw.scale[e].double()).T
                      for e, (a, b) in enumerate(zip([0] + ends[:-1], ends))])


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
def test_matches_torch_kernel_and_fp64(platform, fast):
    spec = GroupedGemmSpec(num_experts=E, in_features=K, out_features=N, dtype=torch.bfloat16, quant="fp8_row",
                           fast_accum=fast)
    ours = platform.grouped_gemm(dataclasses.replace(spec, grouped_fp8="cutlass"))
    stock = platform.grouped_gemm(dataclasses.replace(spec, grouped_fp8="torch"))
    assert ours.kernel is not None and stock.kernel is None, (ours.name, stock.name)
    x, w, offs = _operands()
    pw = ours.prepare_weight(w)
    y, y_torch = ours(x, pw, offs), stock(x, pw, offs)
    xq, xs = quant.quantize_fp8(x, per_row=True)
    exact = fp64_product(xq, xs, pw, offs)
    rel = float((y.double() - exact).norm() / exact.norm())
    rel_torch = float((y_torch.double() - exact).norm() / exact.norm())
    assert rel < 4e-3, rel  # bf16 output rounding and the tensor cores' accumulation
    assert rel <= rel_torch * 1.05 + 1e-6, (rel, rel_torch)  # no worse than torch's own kernel
    assert torch.isfinite(y).all()


def test_replays_from_a_captured_graph_with_new_routing(platform):
    spec = GroupedGemmSpec(num_experts=E, in_features=K, out_features=N, dtype=torch.bfloat16, quant="fp8_row",
                           fast_accum=True, grouped_fp8="cutlass")
    gemm = platform.grouped_gemm(spec)
    x, w, offs = _operands(1)
    pw = gemm.prepare_weight(w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemm(x, pw, offs)  # warm-up outside the graph, as the engine does
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemm(x, pw, offs)
    x.copy_(torch.randn_like(x.float()).bfloat16())
    offs.copy_(torch.tensor([100, 100, 500, 900, 1000, 1200, 1300, 1403], device="cuda", dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(y, gemm(x, pw, offs), rtol=0, atol=0)


@pytest.mark.parametrize("fast,n", [(True, N), (False, N), (True, 320)], ids=["fast", "exact", "fast-partial-n"])
def test_swiglu_epilogue_against_fp64(platform, fast, n):
    """The SwiGLU epilogue: ``x1 * silu(x2)`` of each column pair of the scaled product, bf16 ``[R, N/2]``, at
    every group shape of COUNTS (empty, one row, partial tiles); within bf16's rounding of the fp64 value.
    ``n`` 320: the fast build's 192-column tiles end in a partial one."""
    from omni.platforms.cuda import cutlass_grouped as cg
    from omni.platforms.cuda.gemm import grouped_swiglu_kernel
    from omni.platforms.cuda.capabilities import detect_caps

    spec = MoESpec(num_experts=E, topk=2, hidden=K, inner=n // 2, dtype=torch.bfloat16, quant="fp8_row",
                   fast_accum=fast, grouped_fp8="cutlass")
    kernel = grouped_swiglu_kernel(spec, detect_caps(0))
    assert kernel is not None and kernel.swiglu
    assert getattr(kernel, "large", kernel).config == cg.SWIGLU_CONFIGS[fast].name  # COUNTS: 175 rows an expert
    x, w, offs = _operands(4, n)
    pw = quant.prepare_weight(w, "fp8_row")
    xq, xs = quant.quantize_fp8(x, per_row=True)
    y = kernel(xq, xs.reshape(-1).float(), pw.data, pw.scale.view(E, n), offs)
    assert y.dtype == torch.bfloat16 and y.shape == (sum(COUNTS), n // 2)
    exact = cg.swiglu_pairs(fp64_product(xq, xs, pw, offs))
    rel = float((y.double() - exact).norm() / exact.norm())
    assert rel < 4e-3, rel  # the bf16 rounding of the product (the fp32 accumulation is far below it)
    # every element, not only the norm: a misplaced pair is off by about the values' RMS; the fp32 accumulation's
    # error is absolute (a near-zero x1 has a large relative error), hence a floor of 5% of the RMS
    bound = 0.01 * exact.abs() + 0.05 * exact.pow(2).mean().sqrt()
    assert ((y.double() - exact).abs() <= bound).all(), float(((y.double() - exact).abs() - bound).max())


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_the_small_tile_build_gives_the_large_build_s_bits(platform, swiglu):
    """The 64-row build (few rows per expert: decode steps) against the 128-row one on the same operands, at a
    decode step's group sizes and at COUNTS: the same bits, every row written; ``BySize`` picks by the mean rows
    per expert."""
    from omni.platforms.cuda import cutlass_grouped as cg
    from omni.platforms.cuda.capabilities import detect_caps

    caps = detect_caps(0)
    large = cg.load(True, caps.nvcc, caps.cutlass_include, swiglu=swiglu)
    small = cg.load(True, caps.nvcc, caps.cutlass_include, swiglu=swiglu, small=True)
    assert small.config == cg.config_of(True, swiglu, small=True).name and small.swiglu == swiglu
    for seed, counts in enumerate(([1, 0, 2, 1, 0, 3, 0, 1], [9, 70, 0, 64, 65, 1, 128, 3], COUNTS)):
        x, w, offs = _operands(10 + seed, counts=counts)
        pw = quant.prepare_weight(w, "fp8_row")
        xq, xs = quant.quantize_fp8(x, per_row=True)
        args = (xq, xs.reshape(-1).float(), pw.data, pw.scale.view(E, N), offs)
        y_small, y_large = small(*args), large(*args)
        assert y_small.shape == (sum(counts), N // 2 if swiglu else N) and torch.isfinite(y_small).all()
        torch.testing.assert_close(y_small, y_large, atol=0, rtol=0)
    both = cg.BySize(large, small, 4)
    assert both.pick(32, E) is small and both.pick(33, E) is large


def test_fused_moe_on_our_kernel_against_torch_kernel_and_fp64(platform):
    """Ours (the SwiGLU epilogue, paired w13) against torch's kernel with the separate pass: the same function to
    within the e4m3 requantization, and no further from the fp64 layer."""
    from omni.platforms.cuda import cutlass_grouped as cg
    from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8

    kw = dict(num_experts=E, topk=2, hidden=K, inner=N // 2, dtype=torch.bfloat16, quant="fp8_row", fast_accum=True)
    ours, stock = platform.moe(MoESpec(grouped_fp8="cutlass", **kw)), platform.moe(MoESpec(grouped_fp8="torch", **kw))
    assert ours.paired is not None and stock.paired is None, (ours.name, stock.name)
    g = torch.Generator(device="cuda").manual_seed(2)
    w13 = torch.randn(E, N, K, device="cuda", generator=g).bfloat16()
    w2 = torch.randn(E, K, N // 2, device="cuda", generator=g).bfloat16()
    x = torch.randn(333, K, device="cuda", generator=g).bfloat16()
    weights, ids = torch.rand(333, E, device="cuda", generator=g).softmax(-1).topk(2, -1)
    y, y_torch = (ours(x, weights, ids, ours.prepare_weights(w13, w2)),
                  stock(x, weights, ids, stock.prepare_weights(w13, w2)))
    few = isinstance(ours.paired.small, GroupedSkinnyFp8)  # Triton's few-row kernel in front (moe.with_few_rows)
    builds = ours.paired.large if few else ours.paired  # the 128- and 64-row CUTLASS builds
    assert builds.large.config == cg.SWIGLU_CONFIGS[True].name and builds.small_rows > 0
    assert f",{cg.CONFIGS[True].name}|" in ours.name and f"swiglu-epilogue[{cg.SWIGLU_CONFIGS[True].name}|" in ours.name
    assert float((y - y_torch).float().norm() / y_torch.float().norm()) < 0.03
    h = torch.einsum("tk,enk->ten", x.double(), w13.double())  # every expert for every token, then pick
    x1, x2 = h.chunk(2, dim=-1)
    a = x1 * torch.nn.functional.silu(x2)
    full = torch.einsum("tei,edi->ted", a, w2.double())
    ref = (full.gather(1, ids[..., None].expand(-1, -1, K)) * weights[..., None].double()).sum(1)
    err, err_torch = (float((v.double() - ref).norm() / ref.norm()) for v in (y, y_torch))
    assert err < 1.1 * err_torch, (err, err_torch)


def test_a_fresh_machine_self_tests_in_a_child_and_keeps_the_verdict(platform, tmp_path, monkeypatch):
    """The built object copied into an empty cache (no verdict): ``load`` runs the child self-test on this device,
    keeps its verdict beside the object, and the kernel it opens matches torch's; the second load spawns nothing."""
    import shutil

    from omni.platforms.cuda import cutlass_grouped as cg
    from omni.platforms.cuda.capabilities import detect_caps

    caps = detect_caps(0)
    built = cg.build(cg.CONFIGS[True], caps.nvcc, caps.cutlass_include)
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path))
    shutil.copy(built, tmp_path / built.name)
    children = []
    real_child = cg.test_in_child
    kernel = cg.load(True, caps.nvcc, caps.cutlass_include, tester=lambda *a: children.append(a) or real_child(*a))
    assert len(children) == 1 and list(tmp_path.glob("*.ok-*sm90*"))
    cg.load(True, caps.nvcc, caps.cutlass_include, tester=lambda *a: children.append(a))
    assert len(children) == 1
    spec = GroupedGemmSpec(num_experts=E, in_features=K, out_features=N, dtype=torch.bfloat16, quant="fp8_row",
                           fast_accum=True, grouped_fp8="torch")
    stock = platform.grouped_gemm(spec)
    x, w, offs = _operands(3)
    pw = stock.prepare_weight(w)
    xq, xs = quant.quantize_fp8(x, per_row=True)
    got = kernel(xq, xs.reshape(-1).float(), pw.data, pw.scale.view(E, N), offs)
    torch.testing.assert_close(got, stock.scaled(xq, xs, pw, offs), atol=0, rtol=0)  # torch's kernel, same operands
