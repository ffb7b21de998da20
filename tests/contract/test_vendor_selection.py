"""Each vendor's kernel selection against made-up devices: what answers, and why the others refused.

No doubles are needed: resolution takes a capability snapshot (``*Caps``),
so an MI250, an Ascend 310P or a torch without the XPU FP8 kernel can be
described on a CPU box. A refusal must carry a reason that names the
platform and the limit; a named backend that cannot serve a spec is refused,
never replaced.
"""
from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from conformance_cases import attention_spec
from doubles.aiter import AiterDouble
from doubles.ipex import IpexDouble
from doubles.torch_musa import MusaFlashDouble
from doubles.torch_npu import TorchNpuDouble
from omni.platforms.musa import attention as musa_attention
from omni.platforms.musa.capabilities import MusaCaps
from omni.platforms.npu import attention as npu_attention, gemm as npu_gemm
from omni.platforms.npu.capabilities import NpuCaps
from omni.platforms.rocm import attention as rocm_attention, gemm as rocm_gemm
from omni.platforms.rocm.capabilities import RocmCaps, load_aiter
from omni.platforms.xpu import attention as xpu_attention, capabilities as xpu_caps, gemm as xpu_gemm
from omni.platforms.xpu.capabilities import XpuCaps
from omni.specs import GemmSpec, GroupedGemmSpec

MI300 = RocmCaps(arch="gfx942", aiter_installed=True, has_scaled_mm=True)
MI250 = dataclasses.replace(MI300, arch="gfx90a")
A2 = NpuCaps(soc="Ascend910B2", graphs=True)
ATLAS_300I = NpuCaps(soc="Ascend310P3")
B70 = XpuCaps(device_name="Intel Arc Pro B70", graphs=True, scaled_mm=True)
S5000 = MusaCaps(cc=(3, 1), flash_installed=True, graphs=True)
S4000 = dataclasses.replace(S5000, cc=(2, 2))

RESOLVE = {"rocm": rocm_attention.resolve, "npu": npu_attention.resolve, "xpu": xpu_attention.resolve,
           "musa": musa_attention.resolve}


@pytest.fixture(autouse=True)
def _vendor_modules(monkeypatch):
    """Builders import the vendor module at resolution: the doubles stand in (no call is made here)."""
    doubles = {"aiter": AiterDouble().module(), "torch_npu": TorchNpuDouble().module(None),
               "intel_extension_for_pytorch": IpexDouble().module(), "flash_attn_interface": MusaFlashDouble().module()}
    for name, module in doubles.items():
        monkeypatch.setitem(sys.modules, name, module)


def _resolve(platform, caps, **kw):
    spec = attention_spec(**{"dtype": "bf16", "head_dim": 128, "gqa": 4, "mask": "causal", "page": 0, **kw})
    reasons: list[str] = []
    return RESOLVE[platform](spec, caps, reasons.append), reasons


@pytest.mark.parametrize("platform,caps,kw,reason", [
    pytest.param("rocm", MI250, {"backend": "aiter"},
                 "rocm: aiter: flash attention is enabled on gfx942/gfx950", marks=pytest.mark.rocm),
    pytest.param("rocm", dataclasses.replace(MI300, aiter_installed=False), {"backend": "aiter"},
                 "aiter: not installed", marks=pytest.mark.rocm),
    pytest.param("rocm", MI300, {"backend": "aiter", "dtype": "fp32"},
                 "aiter: needs fp16/bf16", marks=pytest.mark.rocm),
    pytest.param("rocm", MI300, {"backend": "aiter", "page": 256},
                 "aiter: paged KV is not wired", marks=pytest.mark.rocm),
    pytest.param("rocm", MI300, {"backend": "aiter", "mask": "dense"},
                 "no arbitrary (dense) masks", marks=pytest.mark.rocm),
    pytest.param("rocm", MI300, {"backend": "fia"}, "rocm: unknown attention backend 'fia'", marks=pytest.mark.rocm),
    pytest.param("npu", ATLAS_300I, {"backend": "fia"}, "npu: fia: runs on Atlas A2/A3", marks=pytest.mark.npu),
    pytest.param("npu", A2, {"backend": "fia", "head_dim": 96},
                 "head_dim a multiple of 16 among 128/192", marks=pytest.mark.npu),
    pytest.param("npu", A2, {"backend": "fia", "head_dim": 64},
                 "(64 without GQA); got 64 with 8/2 heads", marks=pytest.mark.npu),
    pytest.param("npu", A2, {"backend": "fia", "page": 16},
                 "npu: fia: paged KV needs page_size a multiple of 128 in 128..512, got 16", marks=pytest.mark.npu),
    pytest.param("npu", A2, {"backend": "fia", "dtype": "fp32"}, "fia: query must be fp16/bf16", marks=pytest.mark.npu),
    pytest.param("npu", A2, {"backend": "sdpa", "page": 16}, "rejects (error 161001)", marks=pytest.mark.npu),
    pytest.param("xpu", dataclasses.replace(B70, ipex="intel_extension_for_pytorch is not installed"),
                 {"backend": "varlen", "mask": "none"},
                 "xpu: varlen: intel_extension_for_pytorch is not installed", marks=pytest.mark.xpu),
    pytest.param("xpu", B70, {"backend": "varlen"}, "full attention only", marks=pytest.mark.xpu),
    pytest.param("xpu", B70, {"backend": "varlen", "mask": "none", "page": 16},
                 "takes no block table", marks=pytest.mark.xpu),
    pytest.param("musa", S4000, {"backend": "fa3"},
                 "musa: fa3: the vendor flash kernels need compute capability >= 3.1, device is 2.2",
                 marks=pytest.mark.musa),
    pytest.param("musa", S5000, {"backend": "fa3", "page": 256},
                 "paged KV unsupported by the vendor flash attention", marks=pytest.mark.musa),
    pytest.param("musa", S5000, {"backend": "fa3", "head_dim": 256},
                 "head_dim % 8 == 0, <= 128", marks=pytest.mark.musa),
    pytest.param("musa", dataclasses.replace(S5000, flash_installed=False), {"backend": "fa3"},
                 "is not installed", marks=pytest.mark.musa),
])
def test_a_named_backend_refuses_with_its_reason_never_falls_back(platform, caps, kw, reason):
    impl, reasons = _resolve(platform, caps, **kw)
    assert impl is None and any(reason in r for r in reasons), reasons
    assert all(r.startswith(f"{platform}: ") for r in reasons), reasons


@pytest.mark.parametrize("platform,caps,kw,expected,skipped", [
    pytest.param("rocm", MI300, {}, "rocm-aiter", "", marks=pytest.mark.rocm),
    pytest.param("rocm", MI250, {}, "rocm-sdpa", "gfx942/gfx950", marks=pytest.mark.rocm),
    pytest.param("npu", A2, {}, "npu-fia", "", marks=pytest.mark.npu),
    pytest.param("npu", A2, {"head_dim": 96}, "npu-sdpa", "head_dim", marks=pytest.mark.npu),
    pytest.param("npu", ATLAS_300I, {}, "npu-sdpa", "Atlas A2/A3", marks=pytest.mark.npu),
    pytest.param("xpu", B70, {"mask": "none"}, "xpu-ipex-varlen", "", marks=pytest.mark.xpu),
    pytest.param("xpu", B70, {}, "xpu-sdpa", "full attention only", marks=pytest.mark.xpu),
    pytest.param("musa", S5000, {}, "musa-flash", "", marks=pytest.mark.musa),
    pytest.param("musa", S4000, {}, "musa-sdpa", "compute capability", marks=pytest.mark.musa),
])
def test_auto_picks_the_fastest_that_fits_and_says_why(platform, caps, kw, expected, skipped):
    impl, reasons = _resolve(platform, caps, **kw)
    assert impl.name == expected and not reasons
    assert (skipped in " ".join(impl.skipped)) if skipped else impl.skipped == ()


@pytest.mark.parametrize("platform,caps", [pytest.param("rocm", MI300, marks=pytest.mark.rocm),
                                           pytest.param("npu", A2, marks=pytest.mark.npu),
                                           pytest.param("xpu", B70, marks=pytest.mark.xpu),
                                           pytest.param("musa", S5000, marks=pytest.mark.musa)])
def test_lse_output_is_refused_until_wired(platform, caps):
    spec = dataclasses.replace(attention_spec("bf16", 128, 4, "causal", 0), return_lse=True)
    reasons: list[str] = []
    assert RESOLVE[platform](spec, caps, reasons.append) is None
    assert reasons == [f"{platform}: attention with a log-sum-exp output: no backend here returns it yet; "
                       "the reference serves it"]


# ----------------------------------------------------------------- GEMMs


def _gemm(resolve, caps, **kw):
    reasons: list[str] = []
    return resolve(GemmSpec(**{"in_features": 64, "out_features": 64, "dtype": torch.bfloat16, **kw}), caps,
                   reasons.append), reasons


@pytest.mark.rocm
def test_rocm_fp8_format_follows_the_architecture():
    mi300, _ = _gemm(rocm_gemm.resolve_linear, MI300, quant="fp8_tensor")
    mi355, _ = _gemm(rocm_gemm.resolve_linear, dataclasses.replace(MI300, arch="gfx950"), quant="fp8_row")
    assert mi300.fp8 == torch.float8_e4m3fnuz and mi355.fp8 == torch.float8_e4m3fn
    assert mi355.out_dtype == torch.bfloat16, "row-wise _scaled_mm on ROCm writes bf16 only"


@pytest.mark.rocm
def test_rocm_fnuz_codes_dequantize_exactly_as_the_reference():
    from omni import quant

    x = torch.randn(64, 128) * torch.logspace(-4, 2, 128)  # normals and subnormals of e4m3
    for per_row in (False, True):
        q, s = rocm_gemm.quantize(x, per_row, torch.float8_e4m3fnuz)
        ref_q, ref_s = quant.quantize_fp8(x, per_row=per_row)
        assert q.dtype == torch.float8_e4m3fnuz
        assert torch.equal(q.float() * s, ref_q.float() * ref_s)


@pytest.mark.parametrize("resolve,caps,kw,reason", [
    pytest.param(rocm_gemm.resolve_linear, MI250, {"quant": "fp8_tensor"},
                 "needs FP8 matrix cores", marks=pytest.mark.rocm),
    pytest.param(rocm_gemm.resolve_linear, MI300, {"quant": "fp8_row", "in_features": 40},
                 "divisible by 16", marks=pytest.mark.rocm),
    pytest.param(rocm_gemm.resolve_linear, MI300, {"quant": "w8a8"},
                 "rocm: quant 'w8a8': w8a8 int8 kernels land later", marks=pytest.mark.rocm),
    pytest.param(rocm_gemm.resolve_linear, MI300, {"quant": "none"},
                 "the reference serves them", marks=pytest.mark.rocm),
    pytest.param(npu_gemm.resolve_linear, A2, {"quant": "fp8_row"}, "fp8 needs Ascend 950", marks=pytest.mark.npu),
    pytest.param(npu_gemm.resolve_linear, A2, {"quant": "w8a8", "dtype": torch.float32},
                 "npu_dynamic_quant, which takes fp16/bf16", marks=pytest.mark.npu),
    pytest.param(npu_gemm.resolve_linear, A2, {"quant": "w8a8", "in_features": 70000},
                 "K, N <= 65535", marks=pytest.mark.npu),
    pytest.param(xpu_gemm.resolve_linear, dataclasses.replace(B70, scaled_mm=False), {"quant": "fp8_tensor"},
                 "no XPU kernel for aten::_scaled_mm", marks=pytest.mark.xpu),
    pytest.param(xpu_gemm.resolve_linear, B70, {"quant": "fp8_row"}, "unverified", marks=pytest.mark.xpu),
])
def test_gemm_refusals(resolve, caps, kw, reason):
    impl, reasons = _gemm(resolve, caps, **kw)
    assert impl is None and any(reason in r for r in reasons), reasons


@pytest.mark.npu
def test_npu_grouped_refusals():
    reasons: list[str] = []
    spec = GroupedGemmSpec(num_experts=4, in_features=64, out_features=64, dtype=torch.float32, quant="w8a8")
    assert npu_gemm.resolve_grouped(spec, A2, reasons.append) is None and "fp16/bf16" in reasons[-1]
    spec = dataclasses.replace(spec, dtype=torch.bfloat16, quant="fp8_tensor")
    assert npu_gemm.resolve_grouped(spec, A2, reasons.append) is None and "Ascend 950" in reasons[-1]


# ----------------------------------------------------------------- vendor imports


@pytest.mark.rocm
def test_aiter_import_failure_is_a_reason(monkeypatch):
    from doubles.device import install_broken

    install_broken(monkeypatch, "aiter", RuntimeError("ROCm version file not found"))
    assert "ROCm version file not found" in load_aiter()
    impl, reasons = _resolve("rocm", MI300, backend="aiter")
    assert impl is None and "importing aiter failed" in reasons[0]


@pytest.mark.xpu
def test_ipex_built_for_another_torch_is_refused_without_importing_it(monkeypatch):
    monkeypatch.setattr(xpu_caps, "version", lambda name: "2.8.10+xpu")
    monkeypatch.setattr(xpu_caps.torch, "__version__", "2.13.0+xpu")
    assert xpu_caps.ipex_problem() == ("intel_extension_for_pytorch 2.8.10+xpu targets torch 2.8, "
                                       "this is torch 2.13.0+xpu")
    monkeypatch.setattr(xpu_caps.torch, "__version__", "2.8.0+xpu")
    assert xpu_caps.ipex_problem() == ""
