"""The doubles check what they claim: a right call passes and matches the reference, wrong ones fail.

Each wrong call below is a mistake a port from CUDA makes: CUDA-style
cumulative lengths (leading 0) or a device tensor on Ascend, SDPA's mask
polarity on Ascend, FA2's 2-tuple window on aiter, unexpanded GQA heads on
IPEX, OCP FP8 on an MI300, ... Each must raise ``ContractViolation`` naming
the rule, so that the conformance runs over the doubles can fail.
"""
from __future__ import annotations

import pytest
import torch

from doubles.aiter import AiterDouble
from doubles.ipex import IpexDouble
from doubles.recording import ContractViolation, reference_attention
from doubles.scaled_mm import ScaledMmDouble
from doubles.torch_musa import MusaFlashDouble
from doubles.torch_npu import TorchNpuDouble

LENGTHS = [2, 3, 5]  # three sequences, 10 packed tokens
CU = [0, 2, 5, 10]


def _tnd(n=2, d=128, t=10, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, n, d, generator=g).to(dtype)


def _triu():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


# ----------------------------------------------------------------- torch_npu: FIA


def _fia(**overrides):
    q, k, v = _tnd(seed=0), _tnd(seed=1), _tnd(seed=2)
    kw = dict(atten_mask=_triu(), actual_seq_lengths=[2, 5, 10], actual_seq_lengths_kv=[2, 5, 10], num_heads=2,
              scale=128 ** -0.5, input_layout="TND", num_key_value_heads=2, sparse_mode=3)
    kw.update(overrides)
    return TorchNpuDouble().npu_fused_infer_attention_score(q, k, v, **kw), (q, k, v)


@pytest.mark.npu
def test_fia_right_call_passes_and_computes_the_reference():
    (out, _lse), (q, k, v) = _fia()
    expected = reference_attention(q, k, v, CU, CU, causal=True, scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), expected.float())


@pytest.mark.npu
@pytest.mark.parametrize("overrides,rule", [
    ({"actual_seq_lengths": [0, 2, 5, 10]}, "WITHOUT the leading 0"),
    ({"actual_seq_lengths_kv": [0, 2, 5, 10]}, "WITHOUT the leading 0"),
    ({"actual_seq_lengths": torch.tensor([2, 5, 10])}, "host list[int]"),
    ({"actual_seq_lengths": [2, 3, 5]}, "ends at 5"),  # per-sequence lengths instead of cumulative ends
    ({"atten_mask": torch.tril(torch.ones(2048, 2048, dtype=torch.bool))}, "SDPA polarity"),
    ({"atten_mask": None}, "needs the compressed 2048x2048 causal mask"),
    ({"num_heads": 1}, "num_heads"),
    ({"input_layout": "BSND"}, "only input_layout='TND'"),
    ({"sparse_mode": 2}, "sparse_mode 2 is not emulated"),
], ids=["leading-0-q", "leading-0-kv", "device-tensor", "lengths-not-cumulative", "sdpa-polarity", "no-mask",
        "num-heads-default", "layout", "left-up-causal"])
def test_fia_rejects_cuda_habits(overrides, rule):
    with pytest.raises(ContractViolation, match=rule.replace("[", r"\[").replace("]", r"\]")):
        _fia(**overrides)


@pytest.mark.npu
def test_fia_rejects_unsupported_tnd_head_dim():
    q = _tnd(d=96)
    with pytest.raises(ContractViolation, match="head dim 128/192"):
        TorchNpuDouble().npu_fused_infer_attention_score(q, q, q, actual_seq_lengths=[2, 5, 10], num_heads=2,
                                                         actual_seq_lengths_kv=[2, 5, 10], input_layout="TND")


@pytest.mark.npu
def test_fia_paged_wants_per_sequence_kv_lengths_and_aligned_blocks():
    q = _tnd()
    pool = torch.randn(4, 128, 2 * 128).bfloat16()  # BnBsH: 4 blocks of 128 tokens, K*D = 256
    table = torch.tensor([[0], [1], [2]], dtype=torch.int32)
    kw = dict(actual_seq_lengths=[2, 5, 10], num_heads=2, input_layout="TND", block_table=table, block_size=128)
    double = TorchNpuDouble()
    double.npu_fused_infer_attention_score(q, pool, pool, actual_seq_lengths_kv=[100, 7, 128], **kw)
    with pytest.raises(ContractViolation, match="each sequence's key count"):  # cumulative: 235 > one block
        double.npu_fused_infer_attention_score(q, pool, pool, actual_seq_lengths_kv=[100, 107, 235], **kw)
    small = pool.view(32, 16, 256)
    with pytest.raises(ContractViolation, match="multiple of 128"):
        double.npu_fused_infer_attention_score(q, small, small, actual_seq_lengths_kv=[10, 7, 16],
                                               **{**kw, "block_size": 16})


# ----------------------------------------------------------------- torch_npu: GEMMs


@pytest.mark.npu
def test_quant_matmul_contract():
    double = TorchNpuDouble()
    x = torch.randn(6, 64).bfloat16()
    xq, x_scale = double.npu_dynamic_quant(x)
    assert xq.dtype == torch.int8 and x_scale.shape == (6,) and x_scale.dtype == torch.float32
    w_KN = torch.randint(-127, 128, (64, 32), dtype=torch.int8)
    w_scale = torch.rand(32) / 100
    y = double.npu_quant_matmul(xq, w_KN, w_scale, pertoken_scale=x_scale, output_dtype=torch.bfloat16)
    assert y.shape == (6, 32) and y.dtype == torch.bfloat16
    with pytest.raises(ContractViolation, match=r"x2 \(K, N\)"):  # an [O, I] weight passed as is
        double.npu_quant_matmul(xq, w_KN.t().contiguous(), w_scale, pertoken_scale=x_scale, output_dtype=torch.bfloat16)
    with pytest.raises(ContractViolation, match="pertoken_scale is fp32"):
        double.npu_quant_matmul(xq, w_KN, w_scale, pertoken_scale=x_scale[:, None], output_dtype=torch.bfloat16)
    with pytest.raises(ContractViolation, match="fp16/bf16 input"):
        double.npu_dynamic_quant(x.float())


@pytest.mark.npu
def test_grouped_matmul_contract():
    double = TorchNpuDouble()
    x, w = torch.randn(10, 16), torch.randn(3, 16, 8)
    ends = torch.tensor([4, 4, 10], dtype=torch.int64)
    kw = dict(group_type=0, split_item=2)
    y = double.npu_grouped_matmul([x], [w], group_list=ends, **kw)[0]
    torch.testing.assert_close(y[4:], x[4:] @ w[2])
    with pytest.raises(ContractViolation, match="int64"):
        double.npu_grouped_matmul([x], [w], group_list=ends.int(), **kw)
    with pytest.raises(ContractViolation, match="end at M=10"):  # counts sent as cumulative ends
        double.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 0, 6]), **kw)
    with pytest.raises(ContractViolation, match="x=\\[tensor\\]"):
        double.npu_grouped_matmul(x, [w], group_list=ends, **kw)


# ----------------------------------------------------------------- aiter, IPEX, MUSA flash, _scaled_mm


def _cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.rocm
def test_aiter_contract():
    double = AiterDouble()
    q = _tnd()
    out = double.flash_attn_varlen_func(q, q, q, _cu(CU), _cu(CU), 5, 5, softmax_scale=0.1, causal=True,
                                        window_size=(-1, -1, 0))
    torch.testing.assert_close(out, reference_attention(q, q, q, CU, CU, causal=True, scale=0.1))
    with pytest.raises(ContractViolation, match="3-tuple"):
        double.flash_attn_varlen_func(q, q, q, _cu(CU), _cu(CU), 5, 5, window_size=(-1, -1))
    with pytest.raises(ContractViolation, match="must start with 0"):
        double.flash_attn_varlen_func(q, q, q, _cu([2, 5, 10]), _cu([2, 5, 10]), 5, 5)
    with pytest.raises(ContractViolation, match="int32"):
        double.flash_attn_varlen_func(q, q, q, _cu(CU, torch.int64), _cu(CU), 5, 5)
    with pytest.raises(ContractViolation, match="longest run is 5"):
        double.flash_attn_varlen_func(q, q, q, _cu(CU), _cu(CU), 4, 5)


@pytest.mark.xpu
def test_ipex_varlen_contract():
    double = IpexDouble()
    q, kv = _tnd(n=4), _tnd(n=2)
    kw = dict(alibi_slopes=None, max_seqlen_q=5, max_seqlen_k=5, pdropout=0.0, softmax_scale=0.1, zero_tensors=False,
              return_softmax=False, gen_=None)
    out = torch.empty_like(q)
    kv4 = kv.repeat_interleave(2, dim=1)
    double.varlen_attention(q, kv4, kv4, out, _cu(CU), _cu(CU), is_causal=False, **kw)
    torch.testing.assert_close(out, reference_attention(q, kv, kv, CU, CU, causal=False, scale=0.1))
    with pytest.raises(ContractViolation, match="equal head counts"):
        double.varlen_attention(q, kv, kv, out, _cu(CU), _cu(CU), is_causal=False, **kw)
    with pytest.raises(ContractViolation, match="is_causal is not emulated"):
        double.varlen_attention(q, kv4, kv4, out, _cu(CU), _cu(CU), is_causal=True, **kw)


@pytest.mark.musa
def test_musa_flash_contract():
    double = MusaFlashDouble()
    q = _tnd()
    out, _lse = double.flash_attn_varlen_func(q, q, q, _cu(CU), _cu(CU), 5, 5, causal=True)
    assert out.shape == q.shape
    with pytest.raises(ContractViolation, match="int32"):
        double.flash_attn_varlen_func(q, q, q, _cu(CU, torch.int64), _cu(CU), 5, 5)


@pytest.mark.rocm
def test_scaled_mm_contract_per_vendor():
    mi300 = ScaledMmDouble(torch.float8_e4m3fnuz, rowwise_out=(torch.bfloat16,))
    a = torch.randn(8, 32).to(torch.float8_e4m3fnuz)
    b = torch.randn(16, 32).to(torch.float8_e4m3fnuz)
    one = torch.tensor(1.0)
    assert mi300(a, b.t(), one, one, out_dtype=torch.bfloat16).shape == (8, 16)
    with pytest.raises(ContractViolation, match="float8_e4m3fnuz"):
        mi300(a.float().to(torch.float8_e4m3fn), b.float().to(torch.float8_e4m3fn).t(), one, one)
    with pytest.raises(ContractViolation, match="column-major"):
        mi300(a, b.t().contiguous(), one, one, out_dtype=torch.bfloat16)
    with pytest.raises(ContractViolation, match="row-wise writes"):
        mi300(a, b.t(), torch.ones(8, 1), torch.ones(1, 16), out_dtype=torch.float16)
