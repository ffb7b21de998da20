"""The cuda platform's CUTLASS grouped fp8 kernel (``kernels.grouped_fp8``), its logic checked on a CPU box.

- where the kernel is chosen, and every refusal's reason, against made-up machines (``Caps``);
- the build: cache key, compile command, lock + atomic rename, cache hits, a failing
  compiler, with a recording stand-in for nvcc (a real executable script);
- the operands ``ScaledGroupedMM`` hands the kernel, through a double that
  computes the product in fp32 on CPU tensors, against the naive oracle.
The kernel itself runs on the device: tests/gpu/test_gpu_cutlass_grouped.py.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import stat
from pathlib import Path

import pytest
import torch

from conformance_cases import naive_grouped, naive_moe
from omni import quant
from omni.platforms.cuda import cutlass_grouped as cg
from omni.platforms.cuda import gemm, moe
from omni.platforms.cuda.capabilities import Caps
from omni.specs import GroupedGemmSpec, MoESpec

H200 = Caps(sm=(9, 0), cuda_version=(13, 0), has_scaled_mm=True, has_grouped_mm=True, has_scaled_grouped_mm=True,
            nvcc="/opt/cuda/bin/nvcc", cutlass_include="/opt/cutlass/include")
GROUPED = GroupedGemmSpec(num_experts=4, in_features=64, out_features=48, dtype=torch.bfloat16, quant="fp8_row",
                          fast_accum=True)
MOE = MoESpec(num_experts=4, topk=2, hidden=64, inner=32, dtype=torch.bfloat16, quant="fp8_row", memory_bound="torch")


class Fp32GroupedDouble:
    """Stands in for the loaded kernel: records each call and computes its documented product in fp32 (with the
    SwiGLU epilogue: ``x1 * silu(x2)`` of each column pair of it, ``cg.swiglu_pairs``)."""

    def __init__(self, fast_accum: bool, swiglu: bool = False, small: bool = False):
        self.config, self.calls = cg.config_of(fast_accum, swiglu, small).name, []
        self.name, self.swiglu = f"double[{self.config}]", swiglu

    def __call__(self, xq_RK, xs_R, wq_ENK, ws_EN, offs_E, group_rows=None):
        self.calls.append(dict(x=(xq_RK.dtype, tuple(xq_RK.shape), xq_RK.is_contiguous()), xs=tuple(xs_R.shape),
                               w=tuple(wq_ENK.shape), ws=tuple(ws_EN.shape), offs=offs_E.dtype,
                               group_rows=group_rows))
        out, start = torch.zeros(xq_RK.shape[0], wq_ENK.shape[1]), 0
        for e, end in enumerate(offs_E.tolist()):
            a = xq_RK[start:end].float() * xs_R[start:end, None]
            out[start:end] = a @ (wq_ENK[e].float() * ws_EN[e][:, None]).T
            start = end
        return (cg.swiglu_pairs(out) if self.swiglu else out).bfloat16()


@pytest.fixture(autouse=True)
def prebuilt(monkeypatch):
    """Records what the resolvers ask ``_prebuild`` to compile (the real one would run nvcc side by side)."""
    asked: list[tuple] = []
    monkeypatch.setattr(gemm, "_prebuild", lambda *args: asked.append(args))
    return asked


@pytest.fixture
def loaded(monkeypatch):
    """The build-and-load step answered by a double (what gemm resolves with), keyed by (fast_accum, swiglu,
    small)."""
    doubles: dict[tuple[bool, bool, bool], Fp32GroupedDouble] = {}

    def load(fast_accum, nvcc, include, swiglu=False, small=False):
        assert (nvcc, include) == (H200.nvcc, H200.cutlass_include)
        return doubles.setdefault((fast_accum, swiglu, small), Fp32GroupedDouble(fast_accum, swiglu, small))
    monkeypatch.setattr(gemm, "_load_cutlass", load)
    return doubles


# ----------------------------------------------------------------- choice and refusals


@pytest.mark.parametrize("choice", ["auto", "cutlass"])
def test_auto_and_a_demand_take_our_kernel_where_it_builds(loaded, choice):
    impl = gemm.resolve_grouped(dataclasses.replace(GROUPED, grouped_fp8=choice), H200, pytest.fail)
    fused = moe.resolve_moe(dataclasses.replace(MOE, grouped_fp8=choice), H200, pytest.fail)
    assert impl.name == "cuda-scaled-grouped-mm[fp8_row,fast-accum,pong_128x128_c1x2_fast|pong_64x128_c1x1_fast<=32]"
    assert fused.name == ("cuda-fused-moe[fp8_row,torch,coop_128x128_c1x2_exact,"  # no fast_accum
                          "swiglu-epilogue[coop_128x128_c1x2_exact_swiglu]]")
    assert fused.gemm2.kernel is loaded[False, False, False]  # GEMM 1 runs the build with the SwiGLU epilogue
    assert fused.gemm13.kernel is fused.paired is loaded[False, True, False]  # exact: no small-tile build
    assert fused.paired.config == "coop_128x128_c1x2_exact_swiglu"


def test_torch_choice_never_builds(loaded):
    impl = gemm.resolve_grouped(dataclasses.replace(GROUPED, grouped_fp8="torch"), H200, pytest.fail)
    fused = moe.resolve_moe(dataclasses.replace(MOE, grouped_fp8="torch"), H200, pytest.fail)
    assert impl.kernel is None and fused.gemm13.kernel is None and not loaded


@pytest.mark.parametrize("caps,reason", [
    (dataclasses.replace(H200, sm=(8, 9)), "built for sm90a (Hopper), this device is sm89"),
    (dataclasses.replace(H200, nvcc=None), "needs nvcc (set CUDA_HOME or put nvcc on PATH)"),
    (dataclasses.replace(H200, cutlass_include=None), "pip install 'omni-run[cuda]'"),
])
def test_a_machine_that_cannot_build_it(loaded, caps, reason):
    """auto falls back to torch's kernel (where torch's runs); a cutlass demand is refused with the reason."""
    reasons: list[str] = []
    demand = gemm.resolve_grouped(dataclasses.replace(GROUPED, grouped_fp8="cutlass"), caps, reasons.append)
    assert demand is None and reasons[0].startswith("cuda: kernels.grouped_fp8=cutlass: ") and reason in reasons[0]
    assert moe.resolve_moe(dataclasses.replace(MOE, grouped_fp8="cutlass"), caps, reasons.append) is None
    assert reasons[1].startswith("cuda-moe: kernels.grouped_fp8=cutlass: ") and reason in reasons[1]
    if caps.sm == (9, 0):
        assert gemm.resolve_grouped(GROUPED, caps, pytest.fail).kernel is None
    assert "cutlass_grouped" not in caps.names() and "cutlass_grouped" in H200.names()  # omni-run platforms
    assert not loaded


def test_a_failed_build_falls_back_under_auto_and_refuses_a_demand(monkeypatch):
    monkeypatch.setattr(gemm, "_load_cutlass", lambda *a: "building or loading it failed: RuntimeError: nvcc failed")
    assert gemm.resolve_grouped(GROUPED, H200, pytest.fail).kernel is None
    reasons: list[str] = []
    assert gemm.resolve_grouped(dataclasses.replace(GROUPED, grouped_fp8="cutlass"), H200, reasons.append) is None
    assert reasons == ["cuda: kernels.grouped_fp8=cutlass: building or loading it failed: RuntimeError: nvcc failed"]


@pytest.mark.parametrize("name", ["rocm", "npu", "xpu", "musa"])
def test_vendors_without_the_kernel_refuse_a_cutlass_demand(name):
    plugin = importlib.import_module(f"omni.platforms.{name}.plugin").plugin
    for spec in (GROUPED, MOE):
        reason = plugin.grouped_refusal(dataclasses.replace(spec, grouped_fp8="cutlass"))
        assert reason == f"{name}: kernels.grouped_fp8=cutlass, but this platform has no such kernel (use auto or torch)"
        assert plugin.grouped_refusal(dataclasses.replace(spec, grouped_fp8="torch")) is None
        assert plugin.grouped_refusal(dataclasses.replace(spec, grouped_fp8="cutlass", quant="none")) is None
    cuda = importlib.import_module("omni.platforms.cuda.plugin").plugin
    assert cuda.grouped_refusal(dataclasses.replace(MOE, grouped_fp8="cutlass")) is None  # cuda decides itself


def test_fast_builds_pair_a_small_tile_picked_by_mean_rows_per_expert(loaded):
    """``spec.small_rows`` = 32 over 4 experts: up to 128 rows take the 64-row build, more the 128-row one; both
    get the same operands (one function)."""
    impl = gemm.resolve_grouped(GROUPED, H200, pytest.fail)
    assert isinstance(impl.kernel, cg.BySize) and impl.kernel.small_rows == 32
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 48, 64, generator=g).bfloat16()
    prepared = impl.prepare_weight(w)
    for rows, picked in ((128, (True, False, True)), (129, (True, False, False))):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        offsets = torch.tensor([rows // 4, rows // 2, 3 * rows // 4, rows])
        y = impl(x, prepared, offsets)
        assert len(loaded[picked].calls) == 1 and loaded[picked].calls[-1]["x"][1] == (rows, 64)
        ref = naive_grouped(GROUPED, x, w, offsets)
        assert float((y.double() - ref).norm() / ref.norm()) < 0.01
    fused = moe.resolve_moe(dataclasses.replace(MOE, fast_accum=True), H200, pytest.fail)
    assert fused.paired.config == "pong_128x192_c1x2_fast_swiglu|pong_64x128_c1x1_fast_swiglu<=32"


def test_small_rows_zero_builds_no_small_tile_and_a_failed_one_costs_only_itself(loaded, monkeypatch, prebuilt):
    off = gemm.resolve_grouped(dataclasses.replace(GROUPED, small_rows=0), H200, pytest.fail)
    assert off.kernel is loaded[True, False, False] and (True, False, True) not in loaded
    assert prebuilt == [(True, H200.nvcc, H200.cutlass_include, False)]
    double = gemm._load_cutlass
    monkeypatch.setattr(gemm, "_load_cutlass", lambda fast, nvcc, include, swiglu=False, small=False: (
        "building or loading it failed: RuntimeError: nvcc failed" if small else double(fast, nvcc, include)))
    assert gemm.resolve_grouped(GROUPED, H200, pytest.fail).kernel is loaded[True, False, False]


def test_the_spec_refuses_a_negative_small_rows():
    with pytest.raises(ValueError, match=r"GroupedGemmSpec.small_rows \(kernels.grouped_fp8_small_rows\)"):
        dataclasses.replace(GROUPED, small_rows=-1)


# ----------------------------------------------------------------- operands


def test_scaled_grouped_mm_hands_the_kernel_the_documented_operands(loaded):
    impl = gemm.resolve_grouped(GROUPED, H200, pytest.fail)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 48, 64, generator=g).bfloat16(), torch.randn(25, 64, generator=g).bfloat16()
    offsets = torch.tensor([5, 5, 20, 25], dtype=torch.int64)  # an empty group; int64 as a sort may give
    y = impl(x, impl.prepare_weight(w), offsets)
    ref = naive_grouped(GROUPED, x, w, offsets)
    assert float((y.double() - ref).norm() / ref.norm()) < 0.01  # bf16 output of the same e4m3 product
    call = loaded[True, False, True].calls[0]  # 25 rows over 4 experts: the small tile
    assert call == dict(x=(torch.float8_e4m3fn, (25, 64), True), xs=(25,), w=(4, 48, 64), ws=(4, 48),
                        offs=torch.int32, group_rows=None)  # a lone grouped GEMM knows no bound on its groups


def test_fused_moe_gathers_rows_the_glue_quantized_as_they_are(loaded):
    """fp8_row: ``RowQuantized`` rows are gathered, not quantized again: the same numbers as plain rows, and the
    e4m3 rows handed in are the ones the experts multiply (a zeroed copy gives zeros)."""
    from omni.specs import RowQuantized

    fused = moe.resolve_moe(MOE, H200, pytest.fail)
    assert fused.accepts_row_quantized
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g).bfloat16()
    w, ids = torch.rand(37, 4, generator=g).softmax(-1).topk(2, -1)
    prepared = fused.prepare_weights(torch.randn(4, 64, 64, generator=g).bfloat16(),
                                     torch.randn(4, 64, 32, generator=g).bfloat16())
    q, s = quant.quantize_fp8(x, per_row=True)
    plain = fused(x, w, ids, prepared)
    assert torch.equal(fused(RowQuantized(q, s, x), w, ids, prepared), plain)
    assert torch.equal(fused(RowQuantized(q, s, None), w, ids, prepared), plain)  # rows not kept: fine
    zeros = fused(RowQuantized(torch.zeros_like(q), s, x), w, ids, prepared)
    assert plain.abs().max() > 0 and zeros.abs().max() == 0
    bf16 = moe.resolve_moe(dataclasses.replace(MOE, quant="none"), H200, pytest.fail)
    assert not bf16.accepts_row_quantized


def _moe_operands(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 64, generator=g).bfloat16()
    w, ids = torch.rand(37, 4, generator=g).softmax(-1).topk(2, -1)
    return x, w, ids, torch.randn(4, 64, 64, generator=g).bfloat16(), torch.randn(4, 64, 32, generator=g).bfloat16()


def test_the_swiglu_epilogue_pairs_w13_rows_and_keeps_the_moe_s_function(loaded):
    """With the SwiGLU epilogue the prepared w13 holds its rows in (x1, x2) pairs, GEMM 1 returns ``[R, I]``,
    and the layer gives the separate pass's result to within its roundings (bf16 h and e4m3 requantization)."""
    fused = moe.resolve_moe(MOE, H200, pytest.fail)
    separate = moe.CudaMoE(MOE, fused.kernels, fused.gemm2.kernel)  # our plain kernel, no epilogue
    x, w, ids, w13, w2 = _moe_operands(2)
    paired, halves = fused.prepare_weights(w13, w2), separate.prepare_weights(w13, w2)
    assert torch.equal(paired.w13.data[:, 0::2], halves.w13.data[:, :32])  # row 2j: the first half's row j
    assert torch.equal(paired.w13.data[:, 1::2], halves.w13.data[:, 32:])  # row 2j + 1: the second half's
    assert torch.equal(paired.w13.scale[:, 1::2], halves.w13.scale[:, 32:]) and paired.w13.scale.shape == (4, 64, 1)
    assert torch.equal(paired.w2.data, halves.w2.data)  # w2 keeps its layout
    y, y_separate = fused(x, w, ids, paired), separate(x, w, ids, halves)
    rel = float((y.float() - y_separate.float()).norm() / y_separate.float().norm())
    assert 0 < rel < 0.03, rel  # not bit-equal (other roundings), within e4m3's step
    [call] = loaded[False, True, False].calls
    assert call["w"] == (4, 64, 64) and call["x"] == (torch.float8_e4m3fn, (74, 64), True)
    ref = naive_moe(MOE, x, w, ids, w13, w2)
    err, err_separate = (float((v.float() - ref).norm() / ref.norm()) for v in (y, y_separate))
    # the fp8 oracle rounds as the epilogue does (no bf16 h; the product rounded before the e4m3 quantization):
    # 0.0023-0.0025 over seeds 2-9, the separate pass 0.006-0.016
    assert err < 0.005 and err < err_separate, (err, err_separate)


def test_a_swiglu_build_that_fails_costs_only_the_fusion(loaded, monkeypatch):
    """The epilogue's build failing leaves the MoE on our plain kernel with its separate SwiGLU pass."""
    double = gemm._load_cutlass
    monkeypatch.setattr(gemm, "_load_cutlass", lambda fast, nvcc, include, swiglu=False, small=False: (
        "building or loading it failed: RuntimeError: nvcc failed" if swiglu else double(fast, nvcc, include)))
    fused = moe.resolve_moe(MOE, H200, pytest.fail)
    assert fused.paired is None and fused.name == "cuda-fused-moe[fp8_row,torch,coop_128x128_c1x2_exact]"
    x, w, ids, w13, w2 = _moe_operands(3)
    prepared = fused.prepare_weights(w13, w2)
    assert torch.equal(prepared.w13.data.float(), quant.prepare_weight(w13, "fp8_row").data.float())  # halves
    ref = naive_moe(MOE, x, w, ids, w13, w2)
    assert float((fused(x, w, ids, prepared).float() - ref).norm() / ref.norm()) < 0.03  # 0.006-0.016 measured


class FewRowsDouble(Fp32GroupedDouble):
    """Stands in for the memory-bound kernels' few-row grouped GEMM (``grouped_skinny_triton``): the same product,
    groups of at most ``max_rows`` rows (at most 16, as the measured tiles) and a ``fits`` that can refuse every
    shape."""

    def __init__(self, max_rows: int, swiglu: bool, takes_shapes: bool = True):
        self.config, self.calls, self.swiglu = f"few<={max_rows}{'_swiglu' if swiglu else ''}", [], swiglu
        self.name, self.max_rows, self.takes_shapes = f"double[{self.config}]", min(max_rows, 16), takes_shapes

    def fits(self, xq_RK, wq_ENK, group_rows=None) -> bool:
        self.asked = group_rows
        return self.takes_shapes and min(xq_RK.shape[0], group_rows or xq_RK.shape[0]) <= self.max_rows


def _few_rows_moe(monkeypatch, takes_shapes: bool = True, **spec):
    """The fused MoE resolved with memory-bound kernels that offer a few-row grouped GEMM (a recording double)."""
    made: dict[bool, FewRowsDouble] = {}

    class WithFewRows(moe.TorchKernels):
        def grouped_skinny_fp8(self, max_rows, swiglu):
            return made.setdefault(swiglu, FewRowsDouble(max_rows, swiglu, takes_shapes))
    monkeypatch.setattr(moe, "memory_kernels", lambda choice, reject, *launch: WithFewRows())
    return moe.resolve_moe(dataclasses.replace(MOE, fast_accum=True, **spec), H200, pytest.fail), made


def test_few_rows_per_expert_take_the_memory_bound_kernels_grouped_gemm(loaded, monkeypatch):
    """fp8_row with fast accumulation: while no group can hold more rows than the few-row kernel takes (16: the
    MoE passes its token count as the bound) both expert GEMMs run it, then the CUTLASS builds by size; the
    layer's function holds."""
    fused, few = _few_rows_moe(monkeypatch)
    assert fused.paired.small is few[True] and fused.gemm2.kernel.small is few[False]
    assert fused.paired.large.config == "pong_128x192_c1x2_fast_swiglu|pong_64x128_c1x1_fast_swiglu<=32"
    assert fused.name.endswith("swiglu-epilogue[pong_128x192_c1x2_fast_swiglu|pong_64x128_c1x1_fast_swiglu<=32|"
                               "few<=16_swiglu<=16]]")
    x, w, ids, w13, w2 = _moe_operands(4)
    prepared = fused.prepare_weights(w13, w2)
    for tokens, kernel in ((16, few), (17, loaded)):  # 2 rows a token; a group of at most 16 rows, then 17
        fused(x[:tokens], w[:tokens], ids[:tokens], prepared)
        picked = (few[True], few[False]) if kernel is few else (loaded[True, True, True], loaded[True, False, True])
        assert [k.calls[-1]["x"][1][0] for k in picked] == [2 * tokens] * 2
        assert [k.calls[-1]["group_rows"] for k in picked] == [tokens] * 2  # a token's 2 experts are distinct
    assert len(few[True].calls) == len(few[False].calls) == 1
    ref = naive_moe(MOE, x[:16], w[:16], ids[:16], w13, w2)
    y = fused(x[:16], w[:16], ids[:16], prepared)
    assert float((y.float() - ref).norm() / ref.norm()) < 0.005  # as the CUTLASS builds' epilogue (above)


def test_the_few_row_kernel_stays_out_where_not_allowed_or_not_fitting(loaded, monkeypatch):
    """skinny_rows 0, exact accumulation or fp8_tensor build no few-row tier; shapes it does not take (its
    ``fits``) go to the CUTLASS builds."""
    for spec in (dict(skinny_rows=0), dict(quant="fp8_tensor")):
        fused, few = _few_rows_moe(monkeypatch, **spec)
        assert not few and fused.gemm2.kernel.config.count("|") <= 1  # asked for none; at most 128|64 rows
    exact = moe.resolve_moe(dataclasses.replace(MOE, fast_accum=False), H200, pytest.fail)
    assert exact.gemm2.kernel is loaded[False, False, False]
    fused, few = _few_rows_moe(monkeypatch, takes_shapes=False)
    x, w, ids, w13, w2 = _moe_operands(5)
    fused(x[:4], w[:4], ids[:4], fused.prepare_weights(w13, w2))
    assert not few[True].calls and not few[False].calls and loaded[True, True, True].calls
    assert few[True].asked == few[False].asked == 4  # asked with the groups' bound: the token count


# ----------------------------------------------------------------- the build


@pytest.fixture
def fake_nvcc(tmp_path):
    """An executable that answers --version and 'compiles' by writing the -o file; it logs each compile."""
    script = tmp_path / "nvcc"
    log = tmp_path / "compiles.log"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi
if [ -n "$FAIL_NVCC" ]; then echo "grouped_fp8.cu(1): error: something is wrong" >&2; exit 2; fi
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo "$@" >> {log}
echo "ELF" > "$out"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    include = tmp_path / "cutlass" / "include"
    (include / "cutlass").mkdir(parents=True)
    (include / "cutlass" / "cutlass.h").write_text("// header\n")
    (include / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 4\n")
    return script, include, log


def test_build_compiles_once_into_the_cache(fake_nvcc, tmp_path):
    nvcc, include, log = fake_nvcc
    cfg = cg.CONFIGS[True]
    first = cg.build(cfg, str(nvcc), str(include), tmp_path / "cache")
    again = cg.build(cfg, str(nvcc), str(include), tmp_path / "cache")
    assert first == again and first.read_text() == "ELF\n" and first.name.startswith(f"grouped_fp8_{cfg.name}_")
    compiles = log.read_text().splitlines()
    assert len(compiles) == 1, compiles  # the second build was a cache hit
    argv = compiles[0].split()
    assert "-arch=sm_90a" in argv and f"-I{include}" in argv and "-shared" in argv
    unit = first.with_suffix(".cu").read_text()
    assert cfg.export_line() in unit and str(cg.SOURCE) in unit
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_a_failing_compiler_raises_with_its_message_and_leaves_nothing(fake_nvcc, tmp_path, monkeypatch):
    nvcc, include, _ = fake_nvcc
    monkeypatch.setenv("FAIL_NVCC", "1")
    with pytest.raises(RuntimeError, match=r"nvcc failed \(2\) building pong_128x128_c1x2_fast:\n.*error: "
                                           r"something is wrong"):
        cg.build(cg.CONFIGS[True], str(nvcc), str(include), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so")) and not list((tmp_path / "cache").glob("*.tmp"))


@pytest.fixture
def loading(fake_nvcc, tmp_path, monkeypatch):
    """``cg.load`` on this CPU machine: the fake compiler, a kernel cache in tmp, device 0 of a made-up model,
    and the ctypes wrapper recorded instead of opened (the fake object is no ELF)."""
    nvcc, include, log = fake_nvcc
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "kcache"))
    monkeypatch.setattr(cg.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cg, "device_tag", lambda device: f"NVIDIA-H200-sm90-driver13000-dev{device}")
    opened = []
    monkeypatch.setattr(cg, "CutlassGroupedFp8", lambda library, config: opened.append((library, config)) or config)
    return str(nvcc), str(include), opened, tmp_path / "kcache"


def test_the_swiglu_epilogue_is_its_own_object_and_self_test(loading):
    nvcc, include, opened, cache = loading
    tested = []
    assert cg.load(True, nvcc, include, tester=lambda *a: tested.append(a), swiglu=True) == \
        "pong_128x192_c1x2_fast_swiglu"
    cg.load(True, nvcc, include, tester=lambda *a: tested.append(a))
    assert [(lib.name.split("_")[-2], cfg) for lib, cfg, _ in tested] == [
        ("swiglu", "pong_128x192_c1x2_fast_swiglu"), ("fast", "pong_128x128_c1x2_fast")]
    assert len(list(cache.glob("*.ok-*"))) == 2


def test_prebuild_compiles_side_by_side_and_reports_each_failure(fake_nvcc, tmp_path, monkeypatch):
    """Every configuration a fast recipe may load is compiled (one nvcc each); a failing compile is returned as
    its error, not raised, so ``load`` reports it itself; the small builds exist for fast accumulation only."""
    nvcc, include, log = fake_nvcc
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "kcache"))
    configs = [cg.config_of(True, swiglu, small) for swiglu in (False, True) for small in (False, True)]
    assert [c.name for c in configs] == ["pong_128x128_c1x2_fast", "pong_64x128_c1x1_fast",
                                         "pong_128x192_c1x2_fast_swiglu", "pong_64x128_c1x1_fast_swiglu"]
    built = cg.prebuild(configs, str(nvcc), str(include))
    assert all(isinstance(b, Path) and b.exists() for b in built) and len(log.read_text().splitlines()) == 4
    assert cg.config_of(False, small=True) is None
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "other"))
    monkeypatch.setenv("FAIL_NVCC", "1")
    failed = cg.prebuild(configs[:2], str(nvcc), str(include))
    assert all(isinstance(f, RuntimeError) and "nvcc failed (2)" in str(f) for f in failed)


def test_prebuild_compiles_small_tiles_only_where_the_recipe_uses_them(loaded, prebuilt):
    """``kernels.grouped_fp8_small_rows: 0`` compiles no 64-row object; exact accumulation has none to compile."""
    names = {(fast, small): [c.name for c in gemm.prebuild_configs(fast, small)]
             for fast in (True, False) for small in (True, False)}
    assert names[True, False] == ["pong_128x128_c1x2_fast", "pong_128x192_c1x2_fast_swiglu"]
    assert names[True, True] == names[True, False][:1] + ["pong_64x128_c1x1_fast"] + names[True, False][1:] + [
        "pong_64x128_c1x1_fast_swiglu"]
    assert names[False, True] == names[False, False] and not any("64x128" in n for n in names[False, True])
    moe.resolve_moe(dataclasses.replace(MOE, fast_accum=True), H200, pytest.fail)
    assert prebuilt and all(args[0] is True and args[3] is True for args in prebuilt)


def test_no_small_build_with_exact_accumulation(loading):
    nvcc, include, _, _ = loading
    with pytest.raises(RuntimeError, match="no small-tile build with fast_accum=False"):
        cg.load(False, nvcc, include, tester=pytest.fail, small=True)


def test_the_self_test_runs_once_per_device_model_before_the_object_is_opened(loading):
    nvcc, include, opened, cache = loading
    tested = []
    assert cg.load(True, nvcc, include, tester=lambda *a: tested.append(a)) == "pong_128x128_c1x2_fast"
    [(library, config, device)] = tested
    assert (config, device) == ("pong_128x128_c1x2_fast", 0) and opened == [(library, config)]
    assert (cache / f"{library.stem}.ok-NVIDIA-H200-sm90-driver13000-dev0").exists()
    cg.load(True, nvcc, include, tester=lambda *a: tested.append(a))
    assert len(tested) == 1 and len(opened) == 2  # the verdict is kept: no second child


def test_a_failed_self_test_opens_nothing_and_keeps_no_verdict(loading):
    nvcc, include, opened, cache = loading

    def fails(library, config, device):
        raise RuntimeError("the self-test of pong_128x128_c1x2_fast failed in a child process (exit 1)")

    with pytest.raises(RuntimeError, match="failed in a child process"):
        cg.load(True, nvcc, include, tester=fails)
    assert opened == [] and not list(cache.glob("*.ok-*"))


def test_the_child_reports_its_failure_with_its_output(tmp_path):
    """A real child process that cannot open its object (on any machine): the parent raises with the child's error."""
    with pytest.raises(RuntimeError, match=r"failed in a child process \(exit 1\):\n(.|\n)*missing\.so: cannot open"):
        cg.test_in_child(tmp_path / "missing.so", "pong_128x128_c1x2_fast", 0)


def test_cache_key_follows_source_config_compiler_and_headers(fake_nvcc):
    _, include, _ = fake_nvcc
    fast, exact = cg.CONFIGS[True], cg.CONFIGS[False]
    key = cg.cache_key(fast, "release 13.0", str(include))
    assert key == cg.cache_key(fast, "release 13.0", str(include))
    assert key != cg.cache_key(exact, "release 13.0", str(include))
    assert key != cg.cache_key(fast, "release 13.1", str(include))
    (include / "cutlass" / "version.h").write_text("#define CUTLASS_MAJOR 5\n")
    assert key != cg.cache_key(fast, "release 13.0", str(include))


def test_exported_configurations_are_read_from_the_symbols(tmp_path):
    library = tmp_path / "lib.so"
    library.write_bytes(b"\x7fELF..omni_gg_pong_128x128_c1x2_fast_run\x00omni_gg_pong_128x128_c1x2_fast_scratch\x00"
                        b"omni_gg_coop_128x256_c1x1_fast_run\x00omni_gg_coop_128x256_c1x1_fast_run\x00")
    assert cg.exported_configs(library) == ["coop_128x256_c1x1_fast", "pong_128x128_c1x2_fast"]


def test_configs_name_their_template_arguments():
    assert cg.CONFIGS[True].export_line() == "OMNI_GG_EXPORT(pong_128x128_c1x2_fast, 128, 128, 128, 1, 2, true, true, 0)"
    assert cg.CONFIGS[False].name == "coop_128x128_c1x2_exact"
    assert cg.SWIGLU_CONFIGS[True].export_line() == \
        "OMNI_GG_EXPORT(pong_128x192_c1x2_fast_swiglu, 128, 192, 128, 1, 2, true, true, 1)"
    assert "OMNI_GG_EXPORT(NAME, TM, TN, TK, CM, CN, PONG, FAST, EPI)" in cg.SOURCE.read_text()


def test_finding_the_compiler_and_the_headers(fake_nvcc, monkeypatch, tmp_path):
    nvcc, include, _ = fake_nvcc
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    os.symlink(nvcc, cuda_home / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(cuda_home))
    assert cg.find_nvcc() == str(cuda_home / "bin" / "nvcc")
    monkeypatch.setenv("OMNI_CUTLASS_INCLUDE", str(include))
    assert cg.find_cutlass_include() == str(include)
    monkeypatch.setenv("OMNI_CUTLASS_INCLUDE", str(tmp_path))  # no cutlass/cutlass.h there
    assert cg.find_cutlass_include() is None
    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path / "k"))
    assert cg.cache_dir() == Path(tmp_path / "k")
