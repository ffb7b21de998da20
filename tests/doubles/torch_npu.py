"""A recording double of ``torch_npu`` (Huawei Ascend) and the ``torch.npu`` device state.

Contract (platform_apis.md 1.4, 2.3):

``npu_fused_infer_attention_score`` (FIA), as the NPU platform calls it in
``input_layout="TND"``: q ``[T, N, D]``, k/v ``[S, K, D]`` or, paged, the
BnBsH pools ``[blocks, block_size, K*D]`` with an int32 ``block_table``
``[B, pages]`` and ``block_size``; ``actual_seq_lengths`` a HOST
``list[int]`` of cumulative query ends WITHOUT the leading 0 (lengths 2,2,2
-> [2, 4, 6]); ``actual_seq_lengths_kv`` the same for keys, or, paged, each
sequence's key count (vllm-ascend's ``seq_lens_list``); ``num_heads`` (default
1) and ``scale`` (default 1.0) are needed; ``num_key_value_heads`` 0 or
K with N/K <= 64; fp16/bf16; TND head dim 128/192 (64 without GQA).
Masks are Ascend's polarity, True = masked OUT: full attention is
``atten_mask=None, sparse_mode=0``; causal is ``sparse_mode=3``
(rightDownCausal, bottom-right aligned) with the compressed 2048x2048
``triu(ones, diagonal=1)``. Other sparse modes, layouts and masks are not
emulated (a violation says so). Returns ``(attention_out, softmax_lse)``.

``npu_dynamic_quant(x)`` -> (int8, fp32 per-token scale (M,)), fp16/bf16 in.
``npu_quant_matmul(x1 int8 (M,K), x2 int8 (K,N), scale (N,)|(1,), *,
pertoken_scale (M,) fp32, output_dtype fp16/bf16)``: W8A8.
``npu_grouped_matmul([x], [w (E,K,N)], *, group_list int64 (E,), group_type=0,
group_list_type=0 (cumsum ends) | 1 (counts), split_item 2|3, scale=[(E,N)],
per_token_scale=[(M,)], output_dtype)`` -> [y].
"""
from __future__ import annotations

import sys

import torch

from omni import quant

from .device import FakeDevice, vendor_module
from .recording import Recorder, ascend_ends, cumulative, host_lengths, reference_attention, require

HALF = (torch.float16, torch.bfloat16)
MASK_SHAPES = ((2048, 2048), (1, 2048, 2048), (1, 1, 2048, 2048))
INT_MAX = 2147483647


def _polarity(mask: torch.Tensor) -> str:
    m = mask.reshape(2048, 2048).bool()
    ones = torch.ones(2048, 2048, dtype=torch.bool)
    if torch.equal(m, torch.triu(ones, diagonal=1)):
        return "True=masked (Ascend)"
    if torch.equal(m, torch.tril(ones)):
        return "True=attend (SDPA)"
    return "other"


class TorchNpuDouble:
    def __init__(self):
        self.recorder = Recorder()

    def module(self, device_module):
        return vendor_module("torch_npu", npu=device_module,
                             npu_fused_infer_attention_score=self.npu_fused_infer_attention_score,
                             npu_dynamic_quant=self.npu_dynamic_quant, npu_quant_matmul=self.npu_quant_matmul,
                             npu_grouped_matmul=self.npu_grouped_matmul)

    # ------------------------------------------------------------- FIA
    def npu_fused_infer_attention_score(
            self, query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
            actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
            quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
            key_antiquant_scale=None, key_antiquant_offset=None, value_antiquant_scale=None,
            value_antiquant_offset=None, block_table=None, query_padding_size=None, kv_padding_size=None,
            key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
            key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX,
            next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
            block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False):
        call = self.recorder.record(
            "npu_fused_infer_attention_score", query=query, key=key, value=value, atten_mask=atten_mask,
            actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
            block_table=block_table, num_heads=num_heads, scale=scale, input_layout=input_layout,
            num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, block_size=block_size,
            pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise)
        require(input_layout == "TND", f"FIA double: only input_layout='TND' is emulated, got {input_layout!r}")
        n, d, kh = self._check_heads(query, key, num_heads, num_key_value_heads, block_table is not None)
        call.notes["mask"] = self._check_mask(atten_mask, sparse_mode, pre_tokens, next_tokens)
        cu_q = [0] + ascend_ends("actual_seq_lengths", actual_seq_lengths, query.shape[0])
        require(len(cu_q) - 1 <= 4096, f"FIA TND: at most 4096 sequences, got {len(cu_q) - 1}")
        extra, k, v, cu_k = self._keys(key, value, actual_seq_lengths_kv, block_table, block_size, len(cu_q) - 1, kh, d)
        call.notes.update(layout="TND", lengths="host cumulative ends, no leading 0")
        out = reference_attention(query, k, v, cu_q, cu_k, causal=sparse_mode == 3, scale=scale, **extra)
        return out, torch.zeros(query.shape[0], n, 1) if softmax_lse_flag else torch.zeros(1)

    def _check_heads(self, query, key, num_heads, num_kv_heads, paged):
        require(query.dim() == 3, f"FIA TND: query is [T, N, D], got {tuple(query.shape)}")
        t, n, d = query.shape
        require(query.dtype in HALF, f"FIA: query must be fp16/bf16, got {query.dtype}")
        require(num_heads == n,
                f"FIA: num_heads={num_heads} but query has {n} heads (num_heads defaults to 1: pass it)")
        kh = num_kv_heads or n
        require(n % kh == 0 and n // kh <= 64 and n <= 256, f"FIA: heads {n}/{kh}: N <= 256, N % K == 0, N/K <= 64")
        require(d in (128, 192) or (d == 64 and kh == n),
                f"FIA TND: head dim 128/192 (64 without GQA), got {d} ({n}/{kh})")
        require(key.dtype == query.dtype, f"FIA: key dtype {key.dtype} != query dtype {query.dtype}")
        width = key.shape[-1] if paged else key.shape[-1] * key.shape[-2]
        require(key.dim() == 3 and width == kh * d,
                f"FIA: key is [S, K, D] (or paged [blocks, block_size, K*D]) with K={kh}, D={d}; "
                f"got {tuple(key.shape)}")
        return n, d, kh

    def _check_mask(self, atten_mask, sparse_mode, pre_tokens, next_tokens) -> str:
        if sparse_mode == 0:
            require(atten_mask is None, "FIA double: sparse_mode=0 is emulated without a mask only (full attention)")
            return "none (sparse_mode=0)"
        require(sparse_mode == 3, f"FIA double: sparse_mode {sparse_mode} is not emulated (0 full, 3 rightDownCausal)")
        require(atten_mask is not None, "FIA: sparse_mode=3 needs the compressed 2048x2048 causal mask")
        require(tuple(atten_mask.shape) in MASK_SHAPES and atten_mask.dtype in (torch.bool, torch.int8, torch.uint8),
                f"FIA: sparse_mode=3 mask is (2048,2048)-like bool/int8/uint8, "
                f"got {tuple(atten_mask.shape)} {atten_mask.dtype}")
        polarity = _polarity(atten_mask)
        require(polarity != "True=attend (SDPA)", "FIA: atten_mask has SDPA polarity (True = attend); Ascend masks are "
                                                  "True = masked out: pass triu(ones(2048, 2048), diagonal=1)")
        require(polarity == "True=masked (Ascend)",
                "FIA: the sparse_mode=3 mask must be triu(ones(2048, 2048), diagonal=1)")
        require(pre_tokens == INT_MAX and next_tokens == INT_MAX,
                "FIA double: sparse_mode=3 ignores windows; leave defaults")
        return "causal, True=masked (triu 2048)"

    def _keys(self, key, value, kv_lengths, block_table, block_size, batch, kh, d):
        if block_table is None:
            cu_k = [0] + ascend_ends("actual_seq_lengths_kv", kv_lengths, key.shape[0])
            require(len(cu_k) == batch + 1, f"FIA: {len(cu_k) - 1} kv lengths for {batch} sequences")
            return {}, key, value, cu_k
        require(block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch,
                f"FIA paged: block_table is int32 [B, pages], got {block_table.dtype} {tuple(block_table.shape)}")
        require(block_size == key.shape[1] and block_size % 128 == 0 and 128 <= block_size <= 512,
                f"FIA paged: block_size must equal the pools' block size and be a multiple of 128 in 128..512, "
                f"got {block_size} (pool block {key.shape[1]})")
        lengths = host_lengths("actual_seq_lengths_kv", kv_lengths)
        capacity = block_table.shape[1] * block_size
        require(len(lengths) == batch and all(0 < n <= capacity for n in lengths),
                f"FIA paged: actual_seq_lengths_kv holds each sequence's key count (<= {capacity}), got {lengths}")
        extra = {"block_table": block_table, "seqused": lengths, "page_size": block_size}
        pools = (t.view(t.shape[0], block_size, kh, d) for t in (key, value))
        return extra, *pools, cumulative(lengths)

    # ------------------------------------------------------------- GEMMs
    def npu_dynamic_quant(self, input, *, smooth_scales=None, group_index=None, dst_type=None):
        self.recorder.record("npu_dynamic_quant", input=input, dst_type=dst_type)
        require(input.dtype in HALF, f"npu_dynamic_quant: fp16/bf16 input, got {input.dtype}")
        require(dst_type in (None, torch.int8), "npu_dynamic_quant double: int8 output only (fp8 is Ascend 950)")
        q, scale = quant.quantize_int8(input)
        return q, scale.squeeze(-1)

    def npu_quant_matmul(self, x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                         x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                         y_scale=None):
        self.recorder.record("npu_quant_matmul", x1=x1, x2=x2, scale=scale, pertoken_scale=pertoken_scale,
                             bias=bias, output_dtype=output_dtype)
        require(x1.dtype == torch.int8 and x2.dtype == torch.int8,
                f"npu_quant_matmul W8A8: int8 x int8, got {x1.dtype} x {x2.dtype}")
        require(x1.dim() == 2 and x2.dim() == 2 and x1.shape[1] == x2.shape[0],
                f"npu_quant_matmul: x1 (M, K) and x2 (K, N), got {tuple(x1.shape)} x {tuple(x2.shape)}")
        (m, k), n = x1.shape, x2.shape[1]
        require(k <= 65535 and n <= 65535, "npu_quant_matmul: K, N <= 65535")
        require(scale.dim() == 1 and scale.numel() in (1, n) and scale.dtype in (torch.float32, torch.bfloat16),
                f"npu_quant_matmul: scale is 1-D (1 or N={n}) fp32/bf16, got {tuple(scale.shape)} {scale.dtype}")
        require(pertoken_scale is not None and tuple(pertoken_scale.shape) == (m,)
                and pertoken_scale.dtype == torch.float32,
                f"npu_quant_matmul: pertoken_scale is fp32 (M,)=({m},)")
        require(output_dtype in HALF, f"npu_quant_matmul double: output_dtype fp16/bf16, got {output_dtype}")
        y = (x1.float() * pertoken_scale[:, None]) @ (x2.float() * scale.float()[None, :])
        return (y if bias is None else y + bias.float()).to(output_dtype)

    def npu_grouped_matmul(self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                           activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                           group_list_type=0, act_type=0, tuning_config=None, output_dtype=None):
        self.recorder.record("npu_grouped_matmul", x=x, weight=weight, scale=scale, per_token_scale=per_token_scale,
                             group_list=group_list, split_item=split_item, group_type=group_type,
                             group_list_type=group_list_type, output_dtype=output_dtype)
        require(isinstance(x, list) and len(x) == 1 and isinstance(weight, list) and len(weight) == 1,
                "npu_grouped_matmul (MoE): x=[tensor], weight=[tensor (E, K, N)]")
        xs, w = x[0], weight[0]
        require(xs.dim() == 2 and w.dim() == 3 and w.shape[1] == xs.shape[1],
                f"npu_grouped_matmul: x (M, K), weight (E, K, N); got {tuple(xs.shape)}, {tuple(w.shape)}")
        require(group_type == 0 and split_item in (2, 3),
                "npu_grouped_matmul: group_type=0 (m-axis), split_item 2/3 (one output)")
        ends = self._group_ends(group_list, group_list_type, w.shape[0], xs.shape[0])
        dequant = self._dequant(xs, w, scale, per_token_scale, output_dtype)
        y = torch.zeros(xs.shape[0], w.shape[2])
        start = 0
        for e, end in enumerate(ends):
            y[start:end] = dequant(start, end, e)
            start = end
        return [y.to(output_dtype or xs.dtype)]

    def _group_ends(self, group_list, group_list_type, experts, rows) -> list[int]:
        require(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64 and group_list.dim() == 1
                and group_list.numel() == experts,
                f"npu_grouped_matmul: group_list is an int64 tensor with E={experts} entries")
        values = group_list.tolist()
        require(group_list_type in (0, 1), "npu_grouped_matmul double: group_list_type 0 (cumsum) or 1 (counts)")
        ends = values if group_list_type == 0 else cumulative(values)[1:]
        require(all(b >= a for a, b in zip(ends, ends[1:])) and ends[-1] == rows,
                f"npu_grouped_matmul: group ends {ends} must be non-decreasing and end at M={rows}")
        return ends

    def _dequant(self, xs, w, scale, per_token_scale, output_dtype):
        if xs.dtype != torch.int8:
            require(xs.dtype == w.dtype and xs.dtype in (*HALF, torch.float32) and scale is None,
                    f"npu_grouped_matmul: float x and weight of one dtype, got {xs.dtype} / {w.dtype}")
            return lambda a, b, e: xs[a:b].float() @ w[e].float()
        e_, n = w.shape[0], w.shape[2]
        require(w.dtype == torch.int8 and output_dtype in HALF,
                "npu_grouped_matmul W8A8: int8 weight, output_dtype fp16/bf16")
        require(isinstance(scale, list) and tuple(scale[0].shape) == (e_, n) and scale[0].dtype == torch.float32,
                f"npu_grouped_matmul W8A8: scale=[fp32 (E, N)=({e_}, {n})]")
        require(isinstance(per_token_scale, list) and tuple(per_token_scale[0].shape) == (xs.shape[0],),
                "npu_grouped_matmul W8A8: per_token_scale=[fp32 (M,)]")
        s, pts = scale[0], per_token_scale[0]
        return lambda a, b, e: (xs[a:b].float() * pts[a:b, None]) @ (w[e].float() * s[e][None, :])


class NpuDoubles:
    def __init__(self, device: FakeDevice, torch_npu: TorchNpuDouble):
        self.device, self.torch_npu = device, torch_npu


def install_npu(monkeypatch, *, soc: str = "Ascend910B2", count: int = 8, graphs: bool = True) -> NpuDoubles:
    """torch_npu importable (the double) and ``torch.npu`` with ``count`` devices of ``soc``."""
    device = FakeDevice(count=count, name=soc, graph_class="NPUGraph" if graphs else None)
    device_module = device.as_module("torch.npu")
    monkeypatch.setattr(torch, "npu", device_module, raising=False)
    double = TorchNpuDouble()
    monkeypatch.setitem(sys.modules, "torch_npu", double.module(device_module))
    return NpuDoubles(device, double)
