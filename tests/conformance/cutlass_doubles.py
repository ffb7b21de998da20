"""What the CPU tests of the cuda platform's CUTLASS grouped kernel share: a made-up H200, the specs, a double
for the loaded kernel, and what the test modules' fixtures ``prebuilt`` (autouse) and ``loaded`` stand in for
the prebuild and the build-and-load step with."""
from __future__ import annotations

import torch

from omni.platforms.cuda import cutlass_grouped as cg
from omni.platforms.cuda import gemm
from omni.platforms.cuda.capabilities import Caps
from omni.specs import GroupedGemmSpec, MoESpec

H200 = Caps(sm=(9, 0), cuda_version=(13, 0), has_scaled_mm=True, has_grouped_mm=True, has_scaled_grouped_mm=True,
            nvcc="/opt/cuda/bin/nvcc", cutlass_include="/opt/cutlass/include")
GROUPED = GroupedGemmSpec(num_experts=4, in_features=64, out_features=48, dtype=torch.bfloat16, quant="fp8_row",
                          fast_accum=True)
MOE = MoESpec(num_experts=4, topk=2, hidden=64, inner=32, dtype=torch.bfloat16, quant="fp8_row", memory_bound="torch")


class Fp32GroupedDouble:
    """Stands in for the loaded kernel: records each call and computes its documented product in fp32 (with the
    SwiGLU epilogue: ``x1 * silu(x2)`` of each column pair of it, ``cg.swiglu_pairs``)."""

    def __init__(self, fast_accum: bool, swiglu: bool = False, small: bool = False):
        self.config, self.calls = cg.config_of(fast_accum, swiglu, small).name, []
        self.name, self.swiglu = f"double[{self.config}]", swiglu

    def __call__(self, xq_RK, xs_R, wq_ENK, ws_EN, offs_E, group_rows=None):
        self.calls.append(dict(x=(xq_RK.dtype, tuple(xq_RK.shape), xq_RK.is_contiguous()), xs=tuple(xs_R.shape),
                               w=tuple(wq_ENK.shape), ws=tuple(ws_EN.shape), offs=offs_E.dtype,
                               group_rows=group_rows))
        out, start = torch.zeros(xq_RK.shape[0], wq_ENK.shape[1]), 0
        for e, end in enumerate(offs_E.tolist()):
            a = xq_RK[start:end].float() * xs_R[start:end, None]
            out[start:end] = a @ (wq_ENK[e].float() * ws_EN[e][:, None]).T
            start = end
        return (cg.swiglu_pairs(out) if self.swiglu else out).bfloat16()


def record_prebuild(monkeypatch):
    """Records what the resolvers ask ``_prebuild`` to compile (the real one would run nvcc side by side)."""
    asked: list[tuple] = []
    monkeypatch.setattr(gemm, "_prebuild", lambda *args: asked.append(args))
    return asked


def load_doubles(monkeypatch):
    """The build-and-load step answered by a double (what gemm resolves with), keyed by (fast_accum, swiglu,
    small)."""
    doubles: dict[tuple[bool, bool, bool], Fp32GroupedDouble] = {}

    def load(fast_accum, nvcc, include, swiglu=False, small=False):
        assert (nvcc, include) == (H200.nvcc, H200.cutlass_include)
        return doubles.setdefault((fast_accum, swiglu, small), Fp32GroupedDouble(fast_accum, swiglu, small))
    monkeypatch.setattr(gemm, "_load_cutlass", load)
    return doubles
