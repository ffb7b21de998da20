"""The CUDA plugin's logic, checked on a CPU box.

- importing it has no side effects;
- backend selection and refusal reasons, against made-up machines (``Caps``);
- the FA3 call contract, against a recording double of the FA3 module;
- kernels that are plain torch (SDPA packing/paging, ``_scaled_mm``,
  ``_grouped_mm``, per-group fp8 scales) run on CPU tensors against the
  naive oracles. Their CUDA runs are in the ``cuda`` conformance cases.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys

import pytest
import torch

from conformance_cases import (TOL, attention_grid, attention_spec, make_attention_case, naive_attention,
                               naive_grouped, naive_linear)
from omni.platforms.common.sdpa import SdpaAttention
from omni.platforms.cuda import attention, gemm
from omni.platforms.cuda.moe import TorchKernels
from omni.platforms.cuda.capabilities import Caps, Fa3
from omni.specs import GemmSpec, GroupedGemmSpec

VARLEN_2_13 = frozenset({"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "return_aux",
                         "scale", "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits"})
VARLEN_2_10 = frozenset({"query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal",
                         "return_aux"})
H100 = Caps(sm=(9, 0), cuda_version=(13, 0), varlen_params=VARLEN_2_13, has_flex=True, has_scaled_mm=True,
            has_grouped_mm=True, has_scaled_grouped_mm=True)
A100 = dataclasses.replace(H100, sm=(8, 0))
OLD_TORCH = dataclasses.replace(H100, varlen_params=VARLEN_2_10, has_scaled_grouped_mm=False)


def test_import_has_no_side_effects():
    flags = "(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, " \
            "torch.get_float32_matmul_precision())"
    code = (
        "import sys, torch\n"
        f"before = {flags}\n"
        "import omni.platforms.cuda.plugin\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialized at import'\n"
        "vendor = [m for m in ('fa3_fwd_interface', 'flash_attn_interface', 'flash_attn') if m in sys.modules]\n"
        "assert not vendor, vendor\n"
        f"after = {flags}\n"
        "assert before == after, (before, after)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_detection_refuses_with_a_reason_without_cuda():
    from omni import platform_manager

    with pytest.raises(platform_manager.PlatformError, match="cuda: "):
        platform_manager.select("cuda")


# ----------------------------------------------------------------- selection against made-up machines


def _resolve(caps, **kw):
    spec = attention_spec(**{"dtype": "bf16", "head_dim": 128, "gqa": 4, "mask": "causal", "page": 0, **kw})
    reasons: list[str] = []
    impl = attention.resolve(spec, caps, reasons.append)
    return impl, reasons


@pytest.mark.parametrize("caps,kw,expected", [
    (H100, {}, "cuda-varlen"),
    (H100, {"dtype": "fp32"}, "cuda-sdpa"),
    (H100, {"mask": "dense"}, "cuda-sdpa"),
    (H100, {"page": 16}, "cuda-sdpa"),
    (H100, {"page": 256}, "cuda-varlen"),
    (H100, {"head_dim": 320}, "cuda-sdpa"),
    (OLD_TORCH, {}, "cuda-varlen"),
    (OLD_TORCH, {"page": 256}, "cuda-sdpa"),
    (H100, {"backend": "sdpa"}, "cuda-sdpa"),
    (H100, {"backend": "flex", "mask": "dense"}, "cuda-flex"),
], ids=["bf16", "fp32", "dense", "page16", "page256", "hd320", "old-torch", "old-torch-paged", "named-sdpa",
        "named-flex"])
def test_auto_and_named_selection(caps, kw, expected):
    impl, reasons = _resolve(caps, **kw)
    assert impl is not None and impl.name == expected and not reasons


def test_auto_records_why_faster_backends_were_skipped():
    impl, _ = _resolve(H100, dtype="fp32")
    assert any("fa3: neither" in r for r in impl.skipped) and any("varlen: needs fp16/bf16" in r for r in impl.skipped)


def test_a_hopper_without_fa3_says_so_once_at_info(caplog):
    """Where FA3 would serve (sm90, auto) but is not installed, the fallback is an INFO line naming the extra, as
    the grouped GEMM's is (a device run missed both wheels and ran at 0.76-0.87x the images/h; only the GEMM's
    line showed)."""
    from omni.platforms.cuda.capabilities import log_once

    log_once.cache_clear()
    caplog.set_level("INFO", logger="omni.platforms")
    _resolve(H100, backend="sdpa")  # a backend the recipe names: nothing to say
    for caps in (A100, H100, H100, dataclasses.replace(H100, fa3_module="fa3_fwd_interface")):
        _resolve(caps, page=256)
    notes = [r.getMessage() for r in caplog.records if "not FA3" in r.getMessage()]
    assert notes == ["cuda: attention runs cuda-varlen, not FA3: neither fa3_fwd_interface nor flash_attn_interface "
                     "is installed (pip install 'omni-run[cuda]' brings fa3-fwd)"], notes


@pytest.mark.parametrize("caps,kw,reason", [
    (H100, {"backend": "fa3"}, "fa3: neither fa3_fwd_interface nor flash_attn_interface is installed"),
    (dataclasses.replace(A100, fa3_module="flash_attn_interface"), {"backend": "fa3"}, "fa3: needs sm90"),
    (H100, {"backend": "varlen", "dtype": "fp32"}, "varlen: needs fp16/bf16"),
    (H100, {"backend": "varlen", "page": 16}, "page_size % 256 == 0, got 16"),
    (H100, {"backend": "varlen", "mask": "dense"}, "varlen: no arbitrary (dense) masks"),
    (OLD_TORCH, {"backend": "varlen", "page": 256}, "takes no block_table"),
    (dataclasses.replace(H100, varlen_params=frozenset()), {"backend": "varlen"}, "varlen_attn is not in this torch"),
    (H100, {"backend": "flex", "page": 16}, "flex: paged KV"),
    (H100, {"backend": "flex", "capturable": True}, "not capturable"),
    (H100, {"backend": "bogus"}, "unknown attention backend 'bogus'"),
], ids=["fa3-missing", "fa3-sm80", "varlen-fp32", "varlen-page16", "varlen-dense", "varlen-old-paged",
        "varlen-missing", "flex-paged", "flex-capture", "unknown"])
def test_named_backend_refuses_with_reason_never_falls_back(caps, kw, reason):
    impl, reasons = _resolve(caps, **kw)
    assert impl is None and any(reason in r for r in reasons), reasons
    assert all(r.startswith("cuda: ") for r in reasons)


def test_varlen_keywords_follow_the_torch_signature():
    new, _ = _resolve(H100)
    old, _ = _resolve(OLD_TORCH)
    assert new.kw == {"scale": 1 / math.sqrt(128), "window_size": (-1, 0), "enable_gqa": True}
    assert old.kw == {"is_causal": True}  # 2.10: default scale, native GQA in the kernel


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("factory,spec,caps,reason", [
    ("linear", GemmSpec(in_features=64, out_features=64, dtype=torch.bfloat16, quant="fp8_row"), A100, ">= 8.9"),
    ("linear", GemmSpec(in_features=40, out_features=64, dtype=BF16, quant="fp8_tensor"), H100, "divisible by 16"),
    ("linear", GemmSpec(in_features=64, out_features=64, dtype=torch.bfloat16, quant="nvfp4"), H100,
     "quant.scheme=nvfp4 needs compute capability 10.0"),
    ("linear", GemmSpec(in_features=64, out_features=64, dtype=torch.bfloat16, quant="mxfp8"), H100,
     "quant.scheme=mxfp8 needs compute capability 10.0"),
    ("linear", GemmSpec(in_features=64, out_features=64, dtype=torch.bfloat16, quant="w8a8"), H100, "land later"),
    ("grouped", GroupedGemmSpec(num_experts=4, in_features=64, out_features=64, dtype=FP16), H100, "bf16 only"),
    ("grouped", GroupedGemmSpec(num_experts=4, in_features=36, out_features=64, dtype=BF16), H100, "16-byte aligned"),
    ("grouped", GroupedGemmSpec(num_experts=4, in_features=64, out_features=64, dtype=torch.bfloat16,
                                quant="fp8_row"), A100, "sm90/sm100 only"),
    ("grouped", GroupedGemmSpec(num_experts=4, in_features=64, out_features=64, dtype=torch.bfloat16,
                                quant="fp8_row"), OLD_TORCH, "_scaled_grouped_mm is not in this torch"),
])
def test_gemm_refusals(factory, spec, caps, reason):
    reasons: list[str] = []
    resolve = gemm.resolve_linear if factory == "linear" else gemm.resolve_grouped
    assert resolve(spec, caps, reasons.append) is None
    assert any(reason in r for r in reasons), reasons


# ----------------------------------------------------------------- FA3 contract (recording double)


class FakeFa3:
    """Records calls; computes with the naive oracle; returns ``(out, lse)`` like older FA3 builds."""

    def __init__(self, spec):
        self.spec, self.calls = spec, []

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal):
        self.calls.append(dict(cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k, scale=softmax_scale, causal=causal))
        from omni.specs import VarlenMeta

        meta = VarlenMeta(cu_seqlens_q_B1=cu_q, cu_seqlens_k_B1=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                          cu_seqlens_q_host=tuple(cu_q.tolist()), cu_seqlens_k_host=tuple(cu_k.tolist()))
        assert causal == (self.spec.mask == "causal")
        return naive_attention(self.spec, q, k, v, meta).to(q.dtype), torch.zeros(1)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_fa3_call_contract(mask):
    spec = attention_spec("bf16", 128, 4, mask, 0, backend="fa3")
    fake = FakeFa3(spec)
    caps = dataclasses.replace(H100, fa3_module="fa3_fwd_interface")
    reasons: list[str] = []
    impl = attention.build_fa3(spec, caps, reasons.append, load=lambda name: Fa3(fake, name, fp16=False, paged=False))
    assert impl.name == "cuda-fa3(fa3_fwd_interface)"
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu")
    out = impl(q, k, v, meta)
    torch.testing.assert_close(out.float(), naive_attention(spec, q, k, v, meta).float(), **TOL[torch.bfloat16])
    assert fake.calls[0]["max_q"] == 32 and fake.calls[0]["scale"] == pytest.approx(1 / math.sqrt(128))
    fp16 = attention_spec("fp16", 128, 4, mask, 0, backend="fa3")
    assert attention.build_fa3(fp16, caps, reasons.append, load=lambda n: Fa3(fake, n, fp16=False)) is None
    assert "without fp16" in reasons[-1]
    paged = attention_spec("bf16", 128, 4, mask, 256, backend="fa3")
    assert attention.build_fa3(paged, caps, reasons.append, load=lambda n: Fa3(fake, n, paged=False)) is None
    assert "without paged KV" in reasons[-1]


# ----------------------------------------------------------------- torch-only kernels on CPU tensors

SDPA_GRID = [c for c in attention_grid() if c[0] in ("fp32", "bf16") and c[1] == 64]


@pytest.mark.parametrize("dtype,head_dim,gqa,mask,page,batch", SDPA_GRID,
                         ids=[f"{d}-h{h}-gqa{g}-{m}-page{p}-{b}" for d, h, g, m, p, b in SDPA_GRID])
def test_cuda_sdpa_kernel_on_cpu_tensors(dtype, head_dim, gqa, mask, page, batch):
    spec = attention_spec(dtype, head_dim, gqa, mask, page, capturable=True)
    impl = SdpaAttention(spec, "cuda-sdpa")
    q, k, v, meta = make_attention_case(spec, batch, "cpu", seed=7)
    torch.testing.assert_close(impl(q, k, v, meta).float(), naive_attention(spec, q, k, v, meta).float(),
                               **TOL[spec.dtype])


def _cpu_rowwise_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:  # 2.11: "Now _scaled_mm only supports per-tensor scaling for CPU backend"
        return False
    return True


@pytest.mark.parametrize("quant,dtype", list(itertools.product(("none", "fp8_tensor", "fp8_row"),
                                                                (torch.bfloat16, torch.float32))))
def test_cuda_linear_kernels_on_cpu_tensors(quant, dtype):
    if quant == "fp8_row" and not _cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm is per-tensor only")
    spec = GemmSpec(in_features=64, out_features=48, dtype=dtype, quant=quant, bias=True)
    impl = gemm.resolve_linear(spec, H100, pytest.fail)
    g = torch.Generator().manual_seed(0)
    w, x, b = (torch.randn(*s, generator=g).to(dtype) for s in ((48, 64), (3, 7, 64), (48,)))
    y = impl(x, impl.prepare_weight(w), b)
    assert y.dtype == dtype and y.shape == (3, 7, 48)
    torch.testing.assert_close(y.float(), naive_linear(spec, x, w, b).float(), **TOL[torch.bfloat16])


class SkinnyDouble:
    """Stands in for the Triton few-row kernel: takes up to ``max_rows`` rows, records each call's operands and
    computes the documented product in fp32."""

    def __init__(self, max_rows: int):
        self.max_rows, self.name, self.calls = max_rows, f"skinny-double[<={max_rows}]", []

    def fits(self, xq_MK) -> bool:
        return 0 < xq_MK.shape[0] <= self.max_rows

    def __call__(self, xq_MK, xs_M1, wq_NK, ws_1N, out_dtype):
        self.calls.append((tuple(xq_MK.shape), tuple(xs_M1.shape), tuple(wq_NK.shape), tuple(ws_1N.shape), out_dtype))
        return ((xq_MK.float() * xs_M1.float()) @ (wq_NK.float() * ws_1N.float().view(-1, 1)).T).to(out_dtype)


class KernelsWithSkinny(TorchKernels):
    def skinny_fp8(self, max_rows: int):
        self.skinny = SkinnyDouble(max_rows)
        return self.skinny


@pytest.mark.parametrize("fast,skinny_rows,bias", [(True, 8, False), (False, 8, False), (True, 0, False),
                                                   (True, 8, True)])
def test_few_rows_take_the_skinny_kernel_only_where_the_spec_allows(fast, skinny_rows, bias, monkeypatch):
    """fp8_row with fast accumulation: up to ``spec.skinny_rows`` rows without a bias run the platform's few-row
    kernel (the same product); more rows, exact accumulation, ``skinny_rows`` 0 or a bias keep ``_scaled_mm``
    (recorded here: this CPU's ``_scaled_mm`` may not take row-wise scales)."""
    cublas = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda xq, *a, **kw: cublas.append(xq.shape[0]) or torch.zeros(
        xq.shape[0], 48, dtype=kw["out_dtype"]))
    spec = GemmSpec(in_features=64, out_features=48, dtype=torch.bfloat16, quant="fp8_row", fast_accum=fast,
                    skinny_rows=skinny_rows, bias=bias)
    kernels = KernelsWithSkinny()
    impl = gemm.Fp8Linear(spec, H100, kernels)
    assert (impl.skinny is not None) == (fast and skinny_rows > 0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g).bfloat16()
    pw, b = impl.prepare_weight(w), (torch.randn(48, generator=g).bfloat16() if bias else None)
    takes = fast and skinny_rows > 0 and not bias
    for rows in (1, 8, 9):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        y = impl(x, pw, b)
        assert y.shape == (rows, 48) and y.dtype == torch.bfloat16
        if takes and rows <= skinny_rows:
            assert kernels.skinny.calls[-1] == ((rows, 64), (rows, 1), (48, 64), (1, 48), torch.bfloat16)
            ref = naive_linear(spec, x, w, None).float()
            assert float((y.float() - ref).norm() / ref.norm()) < 0.05  # e4m3 operands, as _scaled_mm's
    assert cublas == ([9] if takes else [1, 8, 9])


def test_grouped_mm_kernel_on_cpu_tensors():
    spec = GroupedGemmSpec(num_experts=4, in_features=64, out_features=48, dtype=torch.bfloat16)
    impl = gemm.resolve_grouped(spec, H100, pytest.fail)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(4, 48, 64, generator=g).bfloat16(), torch.randn(25, 64, generator=g).bfloat16()
    offsets = torch.tensor([5, 5, 20, 25], dtype=torch.int32)
    y = impl(x, impl.prepare_weight(w), offsets)
    torch.testing.assert_close(y.float(), naive_grouped(spec, x, w, offsets).float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("T,k", [(1, 1), (37, 3), (300, 8)])
def test_scatter_rows_puts_each_token_row_at_its_sorted_rows(T, k):
    """The definition the Triton scatter is held to (its GPU test: bit for bit): the rows by sorted row, each
    the row of that row's token in the stable sort by expert."""
    from omni.platforms.cuda.moe import torch_route_rows

    g = torch.Generator().manual_seed(T)
    q = torch.randn(T, 64, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(T, 1, generator=g)
    ids = torch.rand(T, 16, generator=g).topk(k, -1).indices
    token_R, inverse_R, _ = torch_route_rows(ids, 16)
    out, out_s = TorchKernels().scatter_rows(q, s, inverse_R)
    assert torch.equal(out.view(torch.uint8), q[token_R].view(torch.uint8)) and torch.equal(out_s, s[token_R])
    assert torch.equal(token_R.sort().values, torch.arange(T).repeat_interleave(k))  # each token k times


def test_group_tensor_scales_match_per_group_absmax():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(25, 64, generator=g) * torch.linspace(0.1, 3, 25)[:, None]
    offsets = torch.tensor([5, 5, 20, 25], dtype=torch.int32)
    scales = gemm.group_tensor_scales(x, offsets, 4)
    start = 0
    for end in offsets.tolist():
        if end > start:
            assert torch.all(scales[start:end] == x[start:end].abs().amax() / 448.0)
        start = end


@pytest.mark.parametrize("mask,gqa", list(itertools.product(("none", "causal", "dense"), (1, 4))))
def test_cuda_flex_masks_on_cpu_tensors(mask, gqa):
    """The document / causal / dense mask_mods, run through eager FlexAttention."""
    from torch.nn.attention.flex_attention import flex_attention

    spec = attention_spec("fp32", 64, gqa, mask, 0, backend="flex")
    impl = attention.FlexAttention(spec)
    impl.flex = flex_attention  # eager: the CPU box has no business compiling kernels here
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu", seed=3)
    torch.testing.assert_close(impl(q, k, v, meta).float(), naive_attention(spec, q, k, v, meta).float(),
                               **TOL[spec.dtype])


def naive_lse(spec, q_TNH, k_SKH, mask_TS):
    """Natural-log log-sum-exp of each query's visible scaled scores (-inf where it sees none)."""
    k = k_SKH.float().repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=1)
    s_NTS = torch.einsum("tnh,snh->nts", q_TNH.float(), k) / math.sqrt(spec.head_dim)
    return s_NTS.masked_fill(~mask_TS, -math.inf).logsumexp(-1).transpose(0, 1)


@pytest.mark.parametrize("gqa", (1, 4))
def test_cuda_flex_returns_the_log_sum_exp_for_ring_attention(gqa):
    """return_lse specs resolve to flex under auto; (o, lse) match the naive oracle, a blind query gives (0, -inf)."""
    from torch.nn.attention.flex_attention import flex_attention

    spec = dataclasses.replace(attention_spec("fp32", 64, gqa, "dense", 0), return_lse=True)
    reasons: list[str] = []
    impl = attention.resolve(spec, H100, reasons.append)
    assert impl.name == "cuda-flex-lse" and impl.returns_lse and not reasons
    impl.flex = flex_attention  # eager on the CPU; the GPU test runs it compiled
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu", seed=5)
    meta.mask_TS[3] = False  # a query that sees no key at all
    o, lse = impl(q, k, v, meta)
    seen = meta.mask_TS.any(-1)  # the naive oracle gives NaN for the blind query; the contract says 0
    torch.testing.assert_close(o[seen].float(), naive_attention(spec, q, k, v, meta)[seen].float(), **TOL[spec.dtype])
    want = naive_lse(spec, q, k, meta.mask_TS)
    assert lse.dtype == torch.float32 and torch.isneginf(lse[3]).all() and torch.all(o[3] == 0)
    torch.testing.assert_close(lse[want.isfinite()], want[want.isfinite()], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend,caps,reason", [
    ("sdpa", H100, "cuda: attention with a log-sum-exp output: only flex returns it here; the reference serves it"),
    ("auto", dataclasses.replace(H100, has_flex=False),
     "cuda: flex: torch.nn.attention.flex_attention is not in this torch"),
])
def test_cuda_declines_lse_attention_it_cannot_serve(backend, caps, reason):
    spec = dataclasses.replace(attention_spec("bf16", 64, 4, "dense", 0, backend=backend), return_lse=True)
    reasons: list[str] = []
    assert attention.resolve(spec, caps, reasons.append) is None
    assert reasons == [reason]

def test_fp32_linear_resolves_to_the_bf16_split_where_mm_writes_fp32():
    from omni.platforms.cuda import gemm
    from omni.specs import GemmSpec

    spec = GemmSpec(in_features=256, out_features=64, dtype=torch.float32)
    assert isinstance(gemm.resolve_linear(spec, dataclasses.replace(H100, has_mm_out_dtype=True), pytest.fail),
                      gemm.SplitFp32Linear)
    assert type(gemm.resolve_linear(spec, dataclasses.replace(H100, has_mm_out_dtype=False), pytest.fail)) \
        is gemm.CudaLinear
    bf16 = dataclasses.replace(spec, dtype=torch.bfloat16)
    assert type(gemm.resolve_linear(bf16, dataclasses.replace(H100, has_mm_out_dtype=True), pytest.fail)) \
        is gemm.CudaLinear


def test_bf16_split_of_an_fp32_weight_is_exact_to_fp32():
    from omni.platforms.cuda.gemm import SplitFp32Linear
    from omni.specs import GemmSpec

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-6, 3, 256)  # magnitudes across nine decades
    lin = SplitFp32Linear(GemmSpec(in_features=256, out_features=64, dtype=torch.float32))
    p = lin.prepare_weight(w)
    assert p.data.dtype == torch.bfloat16 and p.data.shape == (192, 256) and p.scale is None
    hi, mid, lo = p.data.double().view(3, 64, 256)
    err = ((hi + mid + lo) - w.double()).abs() / w.double().abs()
    assert float(err.max()) <= 2.0 ** -26  # below half an fp32 ulp (2^-24) with margin
    assert float(((hi - w.double()).abs() / w.double().abs()).max()) > 2.0 ** -12  # hi alone is not enough
    x = torch.randn(5, 256, generator=g)  # fp32 rows (no bf16 tensor cores on them): the recombined weight
    torch.testing.assert_close(lin(x, p), x @ w.T, atol=1e-4, rtol=1e-5)
