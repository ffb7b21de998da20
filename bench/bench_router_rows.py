"""The MoE router's fp32 product at a decode step's few rows: one Triton launch against the split GEMM.

At the released router (bf16 rows ``[M, 4096]`` times an fp32 ``[64, 4096]``
weight held as three bf16 parts) and ``--rows`` rows: ``SplitFp32Linear``'s
split GEMM (``aten::mm.dtype`` on the parts, cuBLAS, and the sum over the
parts: three kernels) against ``router_triton.SplitFp32Few`` (one), each
captured ``--chain`` times into a CUDA graph and replayed round robin, as the
decode step runs them. Reported: microseconds per router product and each
one's relative error against the fp64 product of the same rows and weight.

    python bench/bench_router_rows.py --rows 1,8,16,32,64 --json out.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import chained_seconds, emit, git_commit, relative  # noqa: E402

from omni.platforms.cuda.gemm import SplitFp32Linear  # noqa: E402
from omni.platforms.cuda.router_triton import SplitFp32Few  # noqa: E402
from omni.specs import GemmSpec  # noqa: E402

D, E = 4096, 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--chain", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(E, D, device="cuda", generator=g) / D ** 0.5
    spec = GemmSpec(in_features=D, out_features=E, dtype=torch.float32)
    gemm, few = SplitFp32Linear(spec), SplitFp32Linear(spec, SplitFp32Few(64))
    pw = gemm.prepare_weight(w)
    rows = []
    for M in map(int, a.rows.split(",")):
        x = torch.randn(M, D, device="cuda", generator=g).bfloat16()
        ref = x.double() @ w.double().T
        fns = {"split gemm (cuBLAS + sum)": lambda x=x: gemm(x, pw), "triton, one launch": lambda x=x: few(x, pw)}
        err = {n: relative(fn(), ref) for n, fn in fns.items()}
        us = {n: s * 1e6 for n, s in chained_seconds(fns, a.chain, a.rounds, burn=20, iters=5).items()}
        row = {"M": M, "us": {n: round(v, 2) for n, v in us.items()}, "rel err vs fp64": err,
               "speedup": round(us["split gemm (cuBLAS + sum)"] / us["triton, one launch"], 3)}
        print(row, flush=True)
        rows.append(row)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "chain": a.chain, "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
