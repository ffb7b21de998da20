"""Programmatic dependent launch of the platform's Triton kernels (``kernels.pdl_rows``, ``platforms/cuda/pdl.py``).

A decode layer's chain of our kernels (residual add + RMSNorm + e4m3 rows, the dense GEMM for few rows, RoPE +
QK-norm, routing, the fused MoE's sort, gathers, grouped GEMMs for few rows and combine, the SwiGLU) built with
PDL, captured into a CUDA graph and replayed on new inputs, gives the bits the same chain gives eagerly without
PDL, with the wait alone and with the early launch of the next kernel.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni.specs import GemmSpec, GlueSpec, MoESpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

triton = pytest.importorskip("triton")
D, H, HEADS, KV_HEADS, E, TOPK, INNER = 1024, 128, 8, 2, 16, 4, 256
QKV = (HEADS + 2 * KV_HEADS) * H


def _ops(platform, pdl_rows: int):
    glue = platform.glue(GlueSpec(hidden=D, head_dim=H, eps=1e-6, dtype=torch.bfloat16, topk=TOPK,
                                  memory_bound="triton", capturable=True, pdl_rows=pdl_rows))
    linear = platform.linear(GemmSpec(in_features=D, out_features=QKV, dtype=torch.bfloat16, quant="fp8_row",
                                      fast_accum=True, memory_bound="triton", pdl_rows=pdl_rows))
    moe = platform.moe(MoESpec(num_experts=E, topk=TOPK, hidden=D, inner=INNER, dtype=torch.bfloat16,
                               quant="fp8_row", fast_accum=True, grouped_fp8="cutlass", memory_bound="triton",
                               capturable=True, pdl_rows=pdl_rows))
    return glue, linear, moe


def _weights(linear, moe):
    g = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()  # noqa: E731
    w = {"norm": rand(D), "q": rand(H), "k": rand(H), "router": rand(E, D).float()}
    w["qkv"] = linear.prepare_weight(rand(QKV, D) / D ** 0.5)
    w["experts"] = moe.prepare_weights(rand(E, 2 * INNER, D) / D ** 0.5, rand(E, D, INNER) / INNER ** 0.5)
    return w


def _inputs(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, d = (torch.randn(tokens, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    angle = torch.rand(tokens, H // 2, device="cuda", generator=g).repeat(1, 2)
    return [x, d, angle.cos().bfloat16(), angle.sin().bfloat16()]


def _layer(ops, w, x, d, cos, sin):
    glue, linear, moe = ops
    h, normed = glue.add_rms_norm(x, d, w["norm"], quantize=True)
    q, k, v = glue.rope_qk_norm(linear(normed, w["qkv"]), cos, sin, w["q"], w["k"], (HEADS, KV_HEADS))
    weights, ids = glue.route(h.float() @ w["router"].T)
    y = moe(h, weights, ids, w["experts"])
    act = glue.swiglu(torch.cat([y, h], -1), quantize=True)
    return q, k, v, y, act.q_TI, act.scale_T1


def _captured(ops, w, inputs):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer(ops, w, *inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(ops, w, *inputs)
    return graph, out


@pytest.mark.parametrize("tokens", [1, 4, 16])  # 16: 64 routed rows, the early launch (TRIGGER_ROWS)
def test_a_layer_with_pdl_captured_and_replayed_gives_the_eager_bits(platform, tokens):
    from omni.platforms.cuda.capabilities import detect_caps

    caps = detect_caps(0)
    if caps.sm < (9, 0) or caps.cutlass_grouped_refusal:
        pytest.skip(f"cuda: PDL and the CUTLASS grouped build need sm90 and nvcc ({caps.sm_name})")
    with_pdl, without = _ops(platform, 512), _ops(platform, 0)
    assert with_pdl[0].pdl.max_rows == with_pdl[1].kernels.pdl.max_rows == with_pdl[2].kernels.pdl.max_rows == 512
    assert without[2].kernels.pdl.max_rows == 0
    w = _weights(with_pdl[1], with_pdl[2])
    inputs = _inputs(tokens, 1)
    graph, captured = _captured(with_pdl, w, inputs)
    for seed in (2, 3):
        for held, fresh in zip(inputs, _inputs(tokens, seed)):
            held.copy_(fresh)
        graph.replay()
        expected = _layer(without, w, *inputs)
        for got, want in zip(captured, expected):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_eager_calls_with_pdl_compute_what_calls_without_compute(platform):
    """Eager launches (a prefill of a few tokens is not captured) under PDL, back to back on one stream."""
    from omni.platforms.cuda.capabilities import detect_caps

    caps = detect_caps(0)
    if caps.sm < (9, 0) or caps.cutlass_grouped_refusal:
        pytest.skip(f"cuda: PDL and the CUTLASS grouped build need sm90 and nvcc ({caps.sm_name})")
    with_pdl, without = _ops(platform, 512), _ops(platform, 0)
    w = _weights(with_pdl[1], with_pdl[2])
    for tokens in (3, 16):  # 16 tokens: 64 routed rows, TRIGGER_ROWS (the early launch)
        inputs = _inputs(tokens, tokens)
        for got, want in zip(_layer(with_pdl, w, *inputs), _layer(without, w, *inputs)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


WARM_THEN_RUN = """
import os, sys
from pathlib import Path
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]  # empty: every compile of this process lands here
sys.path.insert(0, sys.argv[2])
import torch
import test_gpu_pdl as t
from omni.platform_manager import select

platform = select("cuda")
platform.device_services(0)
binaries = lambda: (torch.cuda.synchronize(), sum(1 for _ in Path(sys.argv[1]).rglob("*.cubin")))[1]
ops = t._ops(platform, 512)
w = t._weights(ops[1], ops[2])
built = binaries()
with torch.inference_mode():
    for tokens in (1, 600):  # a server's warm-up: one answer's step, an image-sized call
        t._layer(ops, w, *t._inputs(tokens, 0))
    warmed = binaries()
    for tokens in (2, 3, 7, 8, 16, 17, 40, 56, 57, 64, 100, 300, 512, 513):
        t._layer(ops, w, *t._inputs(tokens, 0))
print(built, warmed, binaries())
"""


def test_after_one_call_of_each_kernel_no_pdl_class_compiles_in_a_request(tmp_path):
    """Each PDL class (none, the wait, the wait and the early launch) is a binary of its own; ``pdl_triton.launch``
    compiles a kernel's classes at its first launch, so once a warm-up has run each kernel, calls of other row
    counts (other classes) compile nothing. Before, the first step of 8 answers compiled 7 kernels (2.1 s)."""
    from omni.platforms.cuda.capabilities import detect_caps

    caps = detect_caps(0)
    if caps.sm < (9, 0) or caps.cutlass_grouped_refusal:
        pytest.skip(f"cuda: PDL and the CUTLASS grouped build need sm90 and nvcc ({caps.sm_name})")
    here = str(Path(__file__).resolve().parent)
    run = subprocess.run([sys.executable, "-c", WARM_THEN_RUN, str(tmp_path), here], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    built, warmed, ran = map(int, run.stdout.split()[-3:])
    assert built < warmed, "the warm-up compiled nothing: the test no longer sees first launches"
    assert ran == warmed, f"{ran - warmed} binaries compiled after the warm-up"
