"""Dense e4m3 GEMMs at a decode step's few rows: the Triton skinny kernel against cuBLAS (issue 17).

At the released model's dense shapes (qkv and the shared expert's gate_up:
K 4096 -> N 6144; o_proj: 4096 -> 4096; the shared expert's down: 3072 ->
4096) and ``--rows`` rows, every launch shape of ``--tiles`` (BLOCK_N x
BLOCK_K, warps, stages) of ``platforms/cuda/skinny_triton.py`` is timed beside
``torch._scaled_mm`` (row-wise scales, fast accumulation: what ``Fp8Linear``
runs), on the same operands, each captured ``--chain`` times into a CUDA graph
(as the decode step is) and replayed round robin. Reported: microseconds per
GEMM, the weight's bytes read per second, and each kernel's relative error
against the fp64 product beside cuBLAS's.

    python bench/bench_skinny_fp8.py --rows 1,8,16,32,64 --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import chained_seconds, emit, git_commit, relative  # noqa: E402

from omni import quant  # noqa: E402
from omni.platforms.cuda.skinny_triton import SkinnyFp8, SkinnyTile  # noqa: E402

SHAPES = {"qkv / shared gate_up": (4096, 6144), "o_proj": (4096, 4096), "shared down": (3072, 4096)}


def tiles(spec: str) -> list[SkinnyTile]:
    """``"16,32,64:256,512:4:3,5"`` -> every (block_n, block_k, warps, stages) of the lists."""
    parts = [list(map(int, p.split(","))) for p in spec.split(":")]
    return [SkinnyTile(*t) for t in itertools.product(*parts)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--tiles", default="16,32,64:256,512:4:3,5", help="block_n list:block_k list:warps list:"
                   "stages list (every combination is timed)")
    p.add_argument("--chain", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    out_rows = []
    for (name, (K, N)), M in itertools.product(SHAPES.items(), map(int, a.rows.split(","))):
        x, w = (torch.randn(M, K, device="cuda", generator=g), torch.randn(N, K, device="cuda", generator=g))
        xq, xs = quant.quantize_fp8(x.bfloat16(), per_row=True)
        pw = quant.prepare_weight(w.bfloat16(), "fp8_row")
        ref = (xq.double() * xs.double()) @ (pw.data.double() * pw.scale.double()).T
        fns = {"cublas": lambda: torch._scaled_mm(xq, pw.data.t(), scale_a=xs, scale_b=pw.scale.view(1, -1),
                                                  out_dtype=torch.bfloat16, use_fast_accum=True)}
        err = {"cublas": relative(fns["cublas"](), ref)}
        for t in tiles(a.tiles):
            k = SkinnyFp8(M, tiles=((M, t),))
            fn = (lambda k=k: k(xq, xs, pw.data, pw.scale))
            try:
                err[k.name] = relative(fn(), ref)
            except Exception as e:  # a launch shape over the shared memory (triton's OutOfResources)
                print(f"skipped {k.name}: {type(e).__name__}", flush=True)
                continue
            fns[k.name] = fn
        us = {n: s * 1e6 for n, s in chained_seconds(fns, a.chain, a.rounds, burn=20, iters=5).items()}
        best = min((n for n in us if n != "cublas"), key=us.get)
        row = {"shape": name, "M": M, "K": K, "N": N, "us": {n: round(v, 2) for n, v in us.items()},
               "weight TB/s": {n: round(N * K / v / 1e6, 2) for n, v in us.items()},
               "rel err vs fp64": err, "best": best, "best speedup vs cublas": round(us["cublas"] / us[best], 3)}
        print({k: row[k] for k in ("shape", "M", "best", "best speedup vs cublas")}, round(us["cublas"], 2),
              round(us[best], 2), flush=True)
        out_rows.append(row)
    summary = {}
    for M in sorted({r["M"] for r in out_rows}):
        at = [r for r in out_rows if r["M"] == M]
        names = set.intersection(*(set(r["us"]) - {"cublas"} for r in at))  # ran at every shape of this M
        worst = {n: min(r["us"]["cublas"] / r["us"][n] for r in at) for n in names}
        pick = max(worst, key=worst.get)
        summary[M] = {"tile with the best worst-shape speedup": pick, "worst-shape speedup": round(worst[pick], 3)}
    print(summary, flush=True)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "chain": a.chain, "rows": out_rows,
                 "summary": summary}, a.json)


if __name__ == "__main__":
    sys.exit(main())
