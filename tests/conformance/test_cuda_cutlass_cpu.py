"""The cuda platform's CUTLASS grouped fp8 kernel (``kernels.grouped_fp8``), its choice and operands checked on a
CPU box.

- where the kernel is chosen, and every refusal's reason, against made-up machines (``Caps``);
- the operands ``ScaledGroupedMM`` hands the kernel, through a double that
  computes the product in fp32 on CPU tensors, against the naive oracle.
The build: test_cuda_cutlass_build_cpu.py. The kernel itself runs on the device: tests/gpu/test_gpu_cutlass_grouped.py.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from conformance_cases import naive_grouped, naive_moe
from cutlass_doubles import GROUPED, H200, MOE, Fp32GroupedDouble, load_doubles, record_prebuild
from omni import quant
from omni.platforms.cuda import cutlass_grouped as cg
from omni.platforms.cuda import gemm, moe

# the prebuild recorded (autouse) and the build-and-load step answered by fp32 doubles: cutlass_doubles
prebuilt = pytest.fixture(autouse=True)(record_prebuild)
loaded = pytest.fixture(load_doubles)


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
        assert reason == (f"{name}: kernels.grouped_fp8=cutlass, but this platform has no such kernel "
                          "(use auto or torch)")
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
