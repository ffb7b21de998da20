"""FA3 through its registered op (``Fa3.fwd``), checked on a CPU box.

The double is a real ``torch.library`` op with the schema fa3-fwd 0.0.3's
``_C`` registers (read from the wheel's shared object), computing the naive
oracle on CPU tensors. It records the keywords the dispatcher hands it, so
the tests see what a build would receive: the split count each Python
wrapper passes, the descales, the lengths. The same kernel on the GPU, both
routes bit for bit, is tests/gpu/test_gpu_fa3_op.py.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest
import torch

from conformance_cases import TOL, attention_spec, make_attention_case, naive_attention
from omni.platforms.cuda import attention
from omni.platforms.cuda.capabilities import Fa3, fa3_raw_fwd
from omni.specs import VarlenMeta

VENDOR_SCHEMA = (
    "fwd(Tensor q,Tensor k,Tensor v,Tensor(k_new!)? k_new = None,Tensor(v_new!)? v_new = None,Tensor? q_v = None,"
    "Tensor(out!)? out = None,Tensor? cu_seqlens_q = None,Tensor? cu_seqlens_k = None,"
    "Tensor? cu_seqlens_k_new = None,Tensor? seqused_q = None,Tensor? seqused_k = None,int? max_seqlen_q = None,"
    "int? max_seqlen_k = None,Tensor? page_table = None,Tensor? kv_batch_idx = None,Tensor? leftpad_k = None,"
    "Tensor? rotary_cos = None,Tensor? rotary_sin = None,Tensor? seqlens_rotary = None,Tensor? q_descale = None,"
    "Tensor? k_descale = None,Tensor? v_descale = None,float? softmax_scale = None,bool is_causal = False,"
    "int window_size_left = -1,int window_size_right = -1,int attention_chunk = 0,float softcap = 0.0,"
    "bool is_rotary_interleaved = False,Tensor? scheduler_metadata = None,int num_splits = 0,bool? pack_gqa = None,"
    "int sm_margin = 0) -> (Tensor(out!), Tensor, Tensor, Tensor)")
# An older build's names (``causal``, no ``num_splits``): the wrappers must be used.
OLD_SCHEMA = ("fwd(Tensor q,Tensor k,Tensor v,Tensor? cu_seqlens_q = None,Tensor? cu_seqlens_k = None,"
              "int? max_seqlen_q = None,int? max_seqlen_k = None,float? softmax_scale = None,bool causal = False)"
              " -> (Tensor, Tensor)")


class OpDouble:
    """A registered op in namespace ``ns`` that records its bound arguments and answers with the oracle."""

    def __init__(self, ns: str, schema: str):
        self.lib, self.calls, self.spec = torch.library.Library(ns, "DEF"), [], None
        self.lib.define(schema)
        self.lib.impl("fwd", self._impl, "CPU")
        self.op = getattr(torch.ops, ns).fwd.default
        self.defaults = {a.name: a.default_value for a in self.op._schema.arguments}
        self.module = types.ModuleType(f"{ns}_interface")  # an interface module holding its op namespace
        self.module.ops = getattr(torch.ops, ns)

    def _impl(self, *args):
        a = {**self.defaults, **dict(zip(self.defaults, args))}  # the dispatcher drops trailing defaults
        self.calls.append(a)
        q, k, v = (self._dequant(a[n], a.get(f"{n}_descale")) for n in ("q", "k", "v"))
        out = naive_attention(self.spec, q, k, v, self._meta(a)).to(torch.bfloat16)
        return out, q.new_zeros(1), q.new_zeros(0), q.new_zeros(0)

    @staticmethod
    def _dequant(x, descale):
        return x if descale is None else x.float() * descale[0, 0]

    @staticmethod
    def _meta(a) -> VarlenMeta:
        cu_q = a["cu_seqlens_q"]
        cu_k = a["cu_seqlens_k"]
        if a["page_table"] is not None:
            cu_k = torch.nn.functional.pad(a["seqused_k"].cumsum(0, dtype=torch.int32), (1, 0))
        return VarlenMeta(cu_seqlens_q_B1=cu_q, cu_seqlens_k_B1=cu_k, max_seqlen_q=a["max_seqlen_q"],
                          max_seqlen_k=int(cu_k.diff().max()), cu_seqlens_q_host=tuple(cu_q.tolist()),
                          cu_seqlens_k_host=tuple(cu_k.tolist()), block_table_BP=a["page_table"],
                          seqused_k_B=a["seqused_k"])


class NoWrappers:
    """The interface's Python wrappers, which the op route must not call."""

    def __getattr__(self, name):
        raise AssertionError(f"the op route called the wrapper {name}")


@pytest.fixture(scope="module")
def vendor():
    return OpDouble("omni_fa3_double", VENDOR_SCHEMA)


def test_the_op_is_found_only_where_its_schema_takes_our_keywords(vendor):
    assert fa3_raw_fwd(vendor.module) is vendor.op
    assert fa3_raw_fwd(OpDouble("omni_fa3_old_double", OLD_SCHEMA).module) is None
    assert fa3_raw_fwd(types.ModuleType("pybind_build")) is None  # an op not registered with torch


@pytest.mark.parametrize("mask,page", [("none", 0), ("causal", 0), ("causal", 256)])
def test_the_op_route_passes_what_the_wrappers_pass(vendor, mask, page):
    spec = attention_spec("bf16", 128, 4, mask, page, backend="fa3")
    vendor.spec, vendor.calls[:] = spec, []
    impl = attention.Fa3Attention(spec, Fa3(NoWrappers(), "fa3_fwd_interface", fwd=vendor.op))
    assert impl.name == "cuda-fa3(fa3_fwd_interface, op)"
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu")
    torch.testing.assert_close(impl(q, k, v, meta).float(), naive_attention(spec, q, k, v, meta).float(),
                               **TOL[torch.bfloat16])
    call = vendor.calls[0]
    assert call["is_causal"] == (mask == "causal") and call["softmax_scale"] == pytest.approx(128 ** -0.5)
    assert call["num_splits"] == (0 if page else 1)  # flash_attn_with_kvcache's default; the varlen wrapper's 1
    assert (call["page_table"] is meta.block_table_BP) and (call["seqused_k"] is meta.seqused_k_B)
    assert call["cu_seqlens_k"] is (None if page else meta.cu_seqlens_k_B1)
    group = spec.num_heads // spec.num_kv_heads  # the paged call leaves packing to FA3 (it packs paged calls)
    assert call["pack_gqa"] == (None if page else attention.fa3_pack_gqa(meta.max_seqlen_q, group, 128))


@pytest.mark.parametrize("queries,group,head_dim,packs", [
    (1, 4, 128, True), (300, 4, 128, True), (4097, 4, 128, False), (1024, 4, 128, False),
    (4097, 1, 128, False), (100, 4, 64, True), (4097, 4, 64, False)])
def test_fa3_packs_query_heads_only_where_one_heads_tiles_would_be_emptier(queries, group, head_dim, packs):
    """FA3's fixed-length rule on the longest query sequence: decode and short prompts pack; the image step's 4097
    queries a row (33 tiles of 128, 97% full) do not; heads that share nothing (MHA) never do."""
    assert attention.fa3_pack_gqa(queries, group, attention.fa3_block_m(head_dim)) is packs


def test_the_varlen_call_packs_per_its_longest_query_sequence(vendor):
    spec = attention_spec("bf16", 128, 4, "none", 0, backend="fa3")
    vendor.spec = spec
    impl = attention.Fa3Attention(spec, Fa3(NoWrappers(), "fa3_fwd_interface", fwd=vendor.op))
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu")
    for longest, packs in ((meta.max_seqlen_q, impl.pack_gqa(meta.max_seqlen_q)), (4097, False), (1, True)):
        vendor.calls[:] = []
        impl(q, k, v, dataclasses.replace(meta, max_seqlen_q=longest))
        assert vendor.calls[0]["pack_gqa"] is packs


class Wrappers:
    """A build's Python varlen wrapper, with or without the ``pack_gqa`` keyword; records the keywords it gets."""

    def __init__(self, takes_pack: bool):
        self.kwargs = None
        if takes_pack:
            self.flash_attn_varlen_func = lambda *a, softmax_scale, causal, pack_gqa=None: self._record(
                a, softmax_scale=softmax_scale, causal=causal, pack_gqa=pack_gqa)
        else:
            self.flash_attn_varlen_func = lambda *a, softmax_scale, causal: self._record(
                a, softmax_scale=softmax_scale, causal=causal)

    def _record(self, args, **kwargs):
        self.kwargs = kwargs
        return torch.zeros_like(args[0])


@pytest.mark.parametrize("takes_pack", [True, False])
def test_the_wrapper_route_passes_pack_gqa_only_to_wrappers_that_take_it(takes_pack):
    spec = attention_spec("bf16", 128, 4, "none", 0, backend="fa3")
    module = Wrappers(takes_pack)
    impl = attention.Fa3Attention(spec, Fa3(module, "flash_attn_interface"))
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu")
    impl(q, k, v, dataclasses.replace(meta, max_seqlen_q=4097))
    assert module.kwargs.get("pack_gqa", "absent") == (False if takes_pack else "absent")


def test_the_op_route_in_fp8_sends_one_descale_per_sequence_and_kv_head(vendor):
    spec = attention_spec("bf16", 128, 4, "causal", 0, backend="fa3")
    spec_fp8 = dataclasses.replace(spec, fp8=True)
    vendor.spec, vendor.calls[:] = spec, []
    impl = attention.Fa3Attention(spec_fp8, Fa3(NoWrappers(), "fa3_fwd_interface", fwd=vendor.op))
    q, k, v, meta = make_attention_case(spec, "q<k", "cpu")
    out = impl(q, k, v, meta)
    call = vendor.calls[0]
    assert call["q"].dtype == torch.float8_e4m3fn and call["num_splits"] == 1
    assert call["k_descale"].shape == (meta.num_seqs, spec.num_kv_heads)
    assert call["q_descale"][0, 0] == pytest.approx(q.float().abs().max().item() / 448, rel=1e-6)
    err = (out.float() - naive_attention(spec, q, k, v, meta).float()).norm() / out.float().norm()
    assert 1e-4 < err < 0.1  # e4m3 products: close to the bf16 answer, not equal to it


def test_the_op_route_imports_no_dynamo_where_the_custom_op_route_does():
    """The reason for the op route: a ``torch.library.custom_op`` call imports ``torch._dynamo`` on first use."""
    code = f"""
import sys, types, torch
from typing import Tuple
from omni.platforms.cuda import attention
from omni.platforms.cuda.capabilities import Fa3, fa3_raw_fwd
from conformance_cases import attention_spec, make_attention_case
lib = torch.library.Library("omni_fa3_sub", "DEF")
lib.define({VENDOR_SCHEMA!r})
lib.impl("fwd", lambda q, *a: (q.clone(), q.new_zeros(1), q.new_zeros(0), q.new_zeros(0)), "CPU")
module = types.ModuleType("fa3_sub_interface"); module.ops = torch.ops.omni_fa3_sub
spec = attention_spec("bf16", 128, 4, "causal", 0, backend="fa3")
impl = attention.Fa3Attention(spec, Fa3(None, "fa3_sub_interface", fwd=fa3_raw_fwd(module)))
impl(*make_attention_case(spec, "q<k", "cpu"))
print("op route:", "torch._dynamo" in sys.modules)

@torch.library.custom_op("omni_fa3_sub::wrapped", mutates_args=(), device_types="cpu")
def wrapped(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return q.clone(), q.new_zeros(1)
wrapped(torch.ones(2))
print("custom op route:", "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=__file__.rsplit("/", 1)[0])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["op route: False", "custom op route: True"], out.stdout


@pytest.mark.parametrize("memory_bound,found,chosen", [
    ("auto", True, "triton"), ("auto", False, "torch"), ("torch", True, "torch"), ("triton", True, "triton"),
    ("triton", False, "refused")])
def test_fp8_quantization_follows_kernels_memory_bound(monkeypatch, memory_bound, found, chosen):
    """As the MoE's and the linears' memory-bound kernels: two Triton passes for ``auto`` where Triton imports and
    for ``triton`` (their bits against torch's: tests/gpu/test_gpu_fp8_tensor_quant.py), torch's ops for ``torch``
    or where Triton is missing; ``triton`` demanded without Triton is refused, naming the setting."""
    if chosen == "triton":
        pytest.importorskip("triton")  # the Triton passes' module imports it (the GPU test runs this choice)
    spec = dataclasses.replace(attention_spec("bf16", 128, 4, "none", 0, backend="fa3"), memory_bound=memory_bound)
    reasons = []
    assert attention.fp8_quantizer(spec, reasons.append) is None and not reasons  # bf16 specs quantize nothing
    monkeypatch.setattr(attention, "triton_found", lambda: found)
    got = attention.fp8_quantizer(dataclasses.replace(spec, fp8=True), reasons.append)
    if chosen == "refused":
        assert got is None and "kernels.memory_bound=triton" in reasons[0]
    elif chosen == "torch":
        assert got is attention.fp8_per_tensor and not reasons
    else:
        assert got.__name__ == "quantize_fp8_per_tensor" and got.__module__.endswith("fp8_tensor_triton")


def test_a_refused_fp8_quantization_refuses_the_spec(monkeypatch):
    monkeypatch.setattr(attention, "triton_found", lambda: False)
    spec = attention_spec("bf16", 128, 4, "none", 0, backend="fa3")
    fp8_spec = dataclasses.replace(spec, fp8=True, memory_bound="triton")
    reasons = []
    assert attention._fa3_build_fits(fp8_spec, Fa3(Wrappers(True), "fa3_fwd_interface"), reasons.append) is None
    assert "kernels.memory_bound=triton" in reasons[0]
    built = attention._fa3_build_fits(dataclasses.replace(fp8_spec, memory_bound="auto"),
                                      Fa3(Wrappers(True), "fa3_fwd_interface"), reasons.append)
    assert built.quantize is attention.fp8_per_tensor


def test_attention_specs_refuse_an_unknown_memory_bound_naming_the_field():
    with pytest.raises(ValueError, match="AttentionSpec.memory_bound"):
        dataclasses.replace(attention_spec("bf16", 128, 4, "none", 0), memory_bound="cuda")
