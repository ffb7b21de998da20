"""A recording double of ``torch._scaled_mm`` that checks the per-vendor FP8 GEMM contract.

Rules (platform_apis.md section 2.1): ``mat1`` (M, K) row-major and ``mat2``
(K, N) column-major (the transposed view of a row-major (N, K) weight), both
in the vendor's FP8 dtype (``float8_e4m3fnuz`` on MI300-class, OCP
``float8_e4m3fn`` elsewhere); K and N divisible by 16; fp32 scales, either
both tensor-wise (numel 1) or row-wise (``scale_a`` (M, 1), ``scale_b`` (1, N));
row-wise output on ROCm is bf16 only; bias bf16/fp16 only. The product is
the real CPU ``torch._scaled_mm`` (exact on FP8 inputs), except for
``float8_e4m3fnuz`` operands on CPUs where torch takes its oneDNN fp8 path
(AMX / avx512-fp16 machines): that path refuses fnuz ("itensor_view_from_dense
expects ... fp8"), so those products are the same exact math in fp32.
"""
from __future__ import annotations

import torch

from .recording import Recorder, require


class ScaledMmDouble:
    def __init__(self, fp8_dtype: torch.dtype, rowwise_out: tuple[torch.dtype, ...], real=torch._scaled_mm):
        self.fp8_dtype, self.rowwise_out, self.real = fp8_dtype, rowwise_out, real
        self.recorder = Recorder()

    def __call__(self, mat1, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                 use_fast_accum=False):
        call = self.recorder.record("_scaled_mm", mat1=mat1, mat2=mat2, scale_a=scale_a, scale_b=scale_b, bias=bias,
                                    out_dtype=out_dtype)
        require(mat1.dtype == self.fp8_dtype and mat2.dtype == self.fp8_dtype,
                f"_scaled_mm: this device computes in {self.fp8_dtype}, got {mat1.dtype} x {mat2.dtype}")
        require(mat1.dim() == 2 and mat2.dim() == 2 and mat1.shape[1] == mat2.shape[0], "_scaled_mm: 2-D (M,K) x (K,N)")
        require(mat1.stride(1) == 1, "_scaled_mm: mat1 must be row-major")
        require(mat2.stride(0) == 1, "_scaled_mm: mat2 must be column-major (pass weight.t() of a row-major [N, K])")
        (m, k), n = mat1.shape, mat2.shape[1]
        require(k % 16 == 0 and n % 16 == 0, f"_scaled_mm: K and N must be divisible by 16, got K={k} N={n}")
        require(scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32, "_scaled_mm: fp32 scales")
        rowwise = scale_a.numel() != 1 or scale_b.numel() != 1
        call.notes["recipe"] = "rowwise" if rowwise else "tensorwise"
        if rowwise:
            require(tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n),
                    f"_scaled_mm row-wise: scale_a (M,1) and scale_b (1,N), got "
                    f"{tuple(scale_a.shape)} {tuple(scale_b.shape)}")
            require(out_dtype in self.rowwise_out,
                    f"_scaled_mm row-wise writes {self.rowwise_out} here, asked {out_dtype}")
        require(bias is None or bias.dtype in (torch.bfloat16, torch.float16), "_scaled_mm: bias must be bf16/fp16")
        if mat1.dtype == torch.float8_e4m3fnuz:
            return _fp32_scaled_mm(mat1, mat2, scale_a, scale_b, bias, out_dtype)
        return self.real(mat1, mat2, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def _fp32_scaled_mm(mat1, mat2, scale_a, scale_b, bias, out_dtype):
    """``(mat1 * scale_a) @ (mat2 * scale_b) (+ bias)`` in fp32: e4m3 products and their sums are exact there."""
    y = (mat1.float() * scale_a) @ (mat2.float() * scale_b.reshape(1, -1) if scale_b.numel() != 1 else
                                    mat2.float() * scale_b)
    return (y if bias is None else y + bias.float()).to(out_dtype or torch.bfloat16)


def install_scaled_mm(monkeypatch, fp8_dtype: torch.dtype, rowwise_out=(torch.bfloat16, torch.float16, torch.float32)):
    double = ScaledMmDouble(fp8_dtype, tuple(rowwise_out))
    monkeypatch.setattr(torch, "_scaled_mm", double)
    return double
