"""Quantized and grouped GEMMs of the NPU platform (torch_npu custom ops).

May assume: torch_npu is imported (detection did it); weights and
activations live on the worker's NPU. Quantization math is ``omni.quant``'s
(symmetric int8, absmax scales): weights are quantized per output channel at
load, activations per token at run time by ``npu_dynamic_quant``, and the
product is dequantized by ``npu_quant_matmul``, as the reference computes it.

Layouts (the kernels', documented here as ``PreparedWeight`` allows):
    W8A8 linear    data ``[I, O]`` int8 (npu_quant_matmul's x2 is (K, N)),
                   scale ``[O]`` fp32 (1-D per-channel).
    grouped        data ``[E, I, O]`` (npu_grouped_matmul's (E, K, N)); with
                   w8a8 int8 and scale ``[E, O]`` fp32.
``offsets_E`` (int32 cumulative row ends) becomes the int64 ``group_list``
with ``group_list_type=0`` (cumsum) on the device: no host sync.
Unquantized dense linears are declined (the reference's ``F.linear`` is
aclnnMatmul already); FP8 exists only on Ascend 950 and lands later.
"""
from __future__ import annotations

import torch

from omni import quant
from omni.specs import GemmSpec, GroupedGemmSpec, PreparedWeight

from .capabilities import NpuCaps, load_torch_npu

HALF = (torch.float16, torch.bfloat16)
MAX_DIM = 65535  # npu_quant_matmul: K and N; npu_grouped_matmul: inner dim < 65536
LATER = {
    "fp8_tensor": "fp8 needs Ascend 950 (npu_quant_matmul on A2/A3 is int8/int4); lands later",
    "fp8_row": "fp8 needs Ascend 950 (npu_quant_matmul on A2/A3 is int8/int4); lands later",
    "mxfp8": "mxfp8 needs Ascend 950 (npu_dynamic_mx_quant); lands later",
    "nvfp4": "nvfp4 is an NVIDIA format; Ascend 950's fp4 path lands later",
}


class W8A8Linear:
    """``npu_dynamic_quant`` (per-token int8) then ``npu_quant_matmul`` (int8 x int8 -> fp16/bf16)."""

    name = "npu-quant-matmul[w8a8]"

    def __init__(self, spec: GemmSpec, torch_npu):
        self.spec, self.npu = spec, torch_npu

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight:
        q_OI, scale_O1 = quant.quantize_int8(w_OI)
        return PreparedWeight(q_OI.t().contiguous(), scale_O1.view(-1))

    def __call__(self, x_TI, w: PreparedWeight, bias_O=None) -> torch.Tensor:
        lead = x_TI.shape[:-1]
        xq, x_scale = self.npu.npu_dynamic_quant(x_TI.reshape(-1, self.spec.in_features).to(self.spec.dtype))
        y = self.npu.npu_quant_matmul(xq, w.data, w.scale, pertoken_scale=x_scale, output_dtype=self.spec.dtype)
        y = y if bias_O is None else y + bias_O
        return y.reshape(*lead, self.spec.out_features)


def resolve_linear(spec: GemmSpec, caps: NpuCaps, reject, load=load_torch_npu):
    if spec.quant == "none":
        return reject("npu: unquantized linears are F.linear (aclnnMatmul); the reference serves them")
    if spec.quant in LATER:
        return reject(f"npu: quant {spec.quant!r}: {LATER[spec.quant]}")
    if spec.dtype not in HALF:
        return reject("npu: w8a8 activations are quantized by npu_dynamic_quant, which takes fp16/bf16, "
                      f"got {spec.dtype}")
    if max(spec.in_features, spec.out_features) > MAX_DIM:
        return reject(f"npu: npu_quant_matmul needs K, N <= {MAX_DIM}, got {spec.in_features}x{spec.out_features}")
    torch_npu = load()
    return reject(torch_npu) if isinstance(torch_npu, str) else W8A8Linear(spec, torch_npu)


class GroupedMatmul:
    """``npu_grouped_matmul`` over expert-sorted rows: one x, one ``(E, I, O)`` weight, one output."""

    def __init__(self, spec: GroupedGemmSpec, torch_npu):
        self.spec, self.npu, self.w8a8 = spec, torch_npu, spec.quant == "w8a8"
        self.name = f"npu-grouped-matmul[{spec.quant}]"

    def prepare_weight(self, w_EOI: torch.Tensor) -> PreparedWeight:
        if not self.w8a8:
            return PreparedWeight(w_EOI.transpose(1, 2).contiguous())
        q_EOI, scale_EO1 = quant.quantize_int8(w_EOI)
        return PreparedWeight(q_EOI.transpose(1, 2).contiguous(), scale_EO1.squeeze(-1))

    def __call__(self, x_TI, w: PreparedWeight, offsets_E) -> torch.Tensor:
        x = x_TI.to(self.spec.dtype)
        kw = {"group_list": offsets_E.to(torch.int64), "group_type": 0, "group_list_type": 0, "split_item": 2}
        if self.w8a8:
            x, x_scale = self.npu.npu_dynamic_quant(x)
            kw.update(scale=[w.scale], per_token_scale=[x_scale], output_dtype=self.spec.dtype)
        return self.npu.npu_grouped_matmul([x], [w.data], **kw)[0]


def resolve_grouped(spec: GroupedGemmSpec, caps: NpuCaps, reject, load=load_torch_npu):
    if spec.quant in LATER:
        return reject(f"npu: quant {spec.quant!r}: {LATER[spec.quant]}")
    if spec.quant == "w8a8" and spec.dtype not in HALF:
        return reject("npu: w8a8 activations are quantized by npu_dynamic_quant, which takes fp16/bf16, "
                      f"got {spec.dtype}")
    if max(spec.in_features, spec.out_features) > MAX_DIM:
        return reject(f"npu: npu_grouped_matmul needs dims < 65536, got {spec.in_features}x{spec.out_features}")
    torch_npu = load()
    return reject(torch_npu) if isinstance(torch_npu, str) else GroupedMatmul(spec, torch_npu)
