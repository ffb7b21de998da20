"""The dense e4m3 GEMM for few rows (``platforms/cuda/skinny_triton.py``) on the device.

- every launch shape of ``TILES`` against the fp64 product and cuBLAS's fast-accumulating ``_scaled_mm`` on the
  same operands: no further from fp64 than cuBLAS, at row counts on both sides of each shape's limit, N not a
  multiple of the tile;
- the platform's ``Fp8Linear`` takes it for few rows (plain and ``RowQuantized`` rows), keeps cuBLAS past
  ``skinny_rows``, and replays it from a CUDA graph on new rows.
"""
from __future__ import annotations

import pytest
import torch

from omni import quant
from omni.specs import GemmSpec, RowQuantized

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

triton = pytest.importorskip("triton")
K, N = 1024, 336  # N: 10.5 tiles of 32, 5.25 of 64


def _operands(rows: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
    w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
    xq, xs = quant.quantize_fp8(x, per_row=True)
    return x, w, xq, xs, quant.prepare_weight(w, "fp8_row")


def _rel(y, ref) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64])
def test_against_fp64_and_cublas(rows):
    from omni.platforms.cuda.skinny_triton import SkinnyFp8

    kernel = SkinnyFp8(64)
    _, _, xq, xs, pw = _operands(rows, rows)
    assert kernel.fits(xq)
    y = kernel(xq, xs, pw.data, pw.scale)
    exact = (xq.double() * xs.double()) @ (pw.data.double() * pw.scale.double()).T
    cublas = torch._scaled_mm(xq, pw.data.t(), scale_a=xs, scale_b=pw.scale.view(1, -1), out_dtype=torch.bfloat16,
                              use_fast_accum=True)
    assert y.shape == (rows, N) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    rel, rel_cublas = _rel(y, exact), _rel(cublas, exact)
    assert rel < 4e-3 and rel <= 1.05 * rel_cublas + 1e-6, (rel, rel_cublas)  # bf16 rounding dominates both


def test_fits_only_device_rows_up_to_its_limit():
    from omni.platforms.cuda.skinny_triton import SkinnyFp8

    kernel = SkinnyFp8(32)
    assert kernel.fits(torch.empty(32, K, dtype=torch.float8_e4m3fn, device="cuda"))
    assert not kernel.fits(torch.empty(33, K, dtype=torch.float8_e4m3fn, device="cuda"))
    assert not kernel.fits(torch.empty(0, K, dtype=torch.float8_e4m3fn, device="cuda"))
    assert not kernel.fits(torch.empty(4, K + 128, dtype=torch.float8_e4m3fn, device="cuda"))  # K off the tile
    assert not kernel.fits(torch.empty(4, K, dtype=torch.float8_e4m3fn))  # host rows
    assert SkinnyFp8(1000).max_rows == 64  # no further than the measured tiles


def test_the_platform_linear_takes_it_for_few_rows_and_replays_it(platform):
    spec = GemmSpec(in_features=K, out_features=N, dtype=torch.bfloat16, quant="fp8_row", fast_accum=True,
                    skinny_rows=16)
    impl = platform.linear(spec)
    assert impl.skinny is not None and "triton-skinny-fp8" in impl.name, impl.name
    x, w, xq, xs, _ = _operands(8, 1)
    pw = impl.prepare_weight(w)
    y = impl(x, pw)
    torch.testing.assert_close(impl(RowQuantized(xq, xs, x), pw), y, atol=0, rtol=0)  # the glue's rows, as they are
    torch.testing.assert_close(y, impl.skinny(xq, xs, pw.data, pw.scale), atol=0, rtol=0)
    many = _operands(32, 2)[0]  # past skinny_rows: cuBLAS, the same function
    exact = many.float() @ w.float().T
    assert _rel(impl(many, pw), exact.double()) < 0.05
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        impl(x, pw)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = impl(x, pw)
    x.copy_(_operands(8, 3)[0])
    graph.replay()
    torch.testing.assert_close(captured, impl(x, pw), atol=0, rtol=0)
