"""The router's fp32 product for a decode step's few rows (``platforms/cuda/router_triton.py``) on the device.

- against the fp64 product of the same bf16 rows and fp32 weight, beside the split GEMM's (cuBLAS, tensor cores):
  no further from fp64, and the same top-8 experts wherever the 8th and 9th logits are apart;
- the platform's router linear takes it up to ``skinny_rows`` rows (plain and with PDL), keeps the GEMM past it,
  and replays it from a CUDA graph on new rows.
"""
from __future__ import annotations

import pytest
import torch

from omni.specs import GemmSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

triton = pytest.importorskip("triton")
D, E = 4096, 64  # the released router


def _case(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g).bfloat16().cuda()
    w = (torch.randn(E, D, generator=g) / D ** 0.5).cuda()
    return x, w


def _rel(y, exact) -> float:
    return float((y.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64])
def test_against_fp64_and_the_split_gemm(platform, rows):
    lin = platform.linear(GemmSpec(in_features=D, out_features=E, dtype=torch.float32))
    assert lin.few is not None and lin.few.max_rows == 64, lin.name
    x, w = _case(rows, rows)
    p = lin.prepare_weight(w)
    assert lin.few.fits(x, p.data)
    ours = lin.few(x, p.data)
    gemm = torch.mm(x, p.data.t(), out_dtype=torch.float32).view(-1, 3, E).sum(1)  # the split GEMM, many rows
    exact = x.double() @ w.double().T
    assert ours.shape == (rows, E) and ours.dtype == torch.float32
    assert _rel(ours, exact) <= _rel(gemm, exact) and _rel(ours, exact) < 1e-5, (_rel(ours, exact), _rel(gemm, exact))
    top_ours, top_ref = ours.topk(9, -1), exact.topk(9, -1)
    clear = (top_ref.values[:, 7] - top_ref.values[:, 8]) > 1e-5
    same = (top_ours.indices[:, :8].sort(-1).values == top_ref.indices[:, :8].sort(-1).values).all(-1)
    assert bool(same[clear].all())


@pytest.mark.parametrize("pdl_rows", [0, 512])
def test_the_router_linear_takes_it_for_few_rows_and_replays_it(platform, pdl_rows):
    lin = platform.linear(GemmSpec(in_features=D, out_features=E, dtype=torch.float32, skinny_rows=8,
                                   pdl_rows=pdl_rows))
    assert "triton-router-rows[<=8]" in lin.name, lin.name
    x, w = _case(8, 1)
    p = lin.prepare_weight(w)
    torch.testing.assert_close(lin(x, p), lin.few(x, p.data), atol=0, rtol=0)
    many = _case(9, 2)[0]  # past skinny_rows: the split GEMM
    torch.testing.assert_close(lin(many, p), torch.mm(many, p.data.t(), out_dtype=torch.float32).view(-1, 3, E).sum(1),
                               atol=0, rtol=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lin(x, p)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lin(x, p)
    x.copy_(_case(8, 3)[0])
    graph.replay()
    torch.testing.assert_close(captured, lin.few(x, p.data), atol=0, rtol=0)
