"""``attention.fp8``'s per-tensor quantization in Triton (``fp8_tensor_triton``) against ``omni.quant``'s, on the GPU.

The two must give the same bits (e4m3 values and the fp32 scale): tensors that are not a multiple of the
program's block, an outlier that sets the scale, values that clamp, an all-zero tensor (the smallest scale), fp16
and bf16; replayed from a CUDA graph as well. FA3's fp8 attention then answers bit for bit as with torch's
quantization.
"""
from __future__ import annotations

import pytest
import torch

from omni import quant

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

triton = pytest.importorskip("triton")


CASES = ("step q", "odd length", "outlier", "fp16", "zeros", "one value")


def _cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    outlier = rand(3000, 8, 128)
    outlier[1234, 5, 7] = 900.0
    return {"step q": rand(8194, 32, 128).bfloat16(), "odd length": rand(12345).bfloat16() * 7,
            "outlier": outlier.bfloat16(), "fp16": rand(777, 8, 128).half() * 1e-3,
            "zeros": torch.zeros(5000, device="cuda", dtype=torch.bfloat16), "one value": rand(1).bfloat16()}


def _same_bits(q, scale, x):
    want_q, want_scale = quant.quantize_fp8(x, per_row=False)
    differ = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
    assert scale.item() == want_scale.item(), f"scale {scale.item()!r} vs omni.quant's {want_scale.item()!r}"
    assert differ == 0, f"{differ} of {q.numel()} e4m3 values differ from omni.quant's"


@pytest.mark.parametrize("name", CASES)
def test_the_triton_passes_give_omni_quants_bits(name):
    from omni.platforms.cuda.fp8_tensor_triton import quantize_fp8_per_tensor

    x = _cases()[name]
    q, scale = quantize_fp8_per_tensor(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (1, 1)
    _same_bits(q, scale, x)


def test_a_replayed_graph_quantizes_new_inputs():
    from omni.platforms.cuda.fp8_tensor_triton import quantize_fp8_per_tensor

    x = _cases()["step q"]
    quantize_fp8_per_tensor(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = quantize_fp8_per_tensor(x)
    for factor in (3.0, 0.25):  # a new absmax each replay: the zeroed cell is part of the graph
        x.mul_(factor)
        graph.replay()
        _same_bits(q, scale, x)


def test_fp8_attention_answers_as_with_torchs_quantization():
    from omni.platforms.cuda.attention import Fa3Attention, fp8_quantizer
    from omni.platforms.cuda.capabilities import detect_caps, load_fa3
    from omni.specs import AttentionSpec, VarlenMeta

    caps = detect_caps(0)
    fa3 = load_fa3(caps.fa3_module) if caps.fa3_module and caps.sm == (9, 0) else "no FA3 on this device"
    if isinstance(fa3, str) or not fa3.fp8:
        pytest.skip(f"no FA3 fp8 here: {fa3}")
    spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, fp8=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2 * 4097, 32, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(2 * 4397, 8, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    cq, ck = (0, 4097, 8194), (0, 4397, 8794)
    t = lambda c: torch.tensor(c, dtype=torch.int32, device="cuda")  # noqa: E731
    meta = VarlenMeta(cu_seqlens_q_B1=t(cq), cu_seqlens_k_B1=t(ck), max_seqlen_q=4097, max_seqlen_k=4397,
                      cu_seqlens_q_host=cq, cu_seqlens_k_host=ck)
    triton_quant, torch_quant = Fa3Attention(spec, fa3, fp8_quantizer(spec, pytest.fail)), Fa3Attention(spec, fa3)
    assert triton_quant.quantize is not torch_quant.quantize
    assert torch.equal(triton_quant(q, k, v, meta), torch_quant(q, k, v, meta))
