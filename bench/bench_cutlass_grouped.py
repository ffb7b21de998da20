"""Our CUTLASS builds of the grouped fp8 expert GEMM against torch._scaled_grouped_mm (issue 17 item 2).

Every configuration exported by the shared objects given (built from
platforms/cuda/csrc/grouped_fp8.cu) is timed beside torch's kernel and the
dense fp8 rate on the same data, at the released MoE shapes (64 experts,
65,552 routed rows: gate_up K 4096 -> N 6144, down K 3072 -> N 4096), with
these row splits: exactly 1024 rows per expert, the counts of a top-8
routing of 8194 random tokens (uneven, as served), and (``--splits one``)
every row to one expert, the dense GEMM's problem through the grouped
kernel: how far the groups cost against the dense rate, apart from the tiles. Two dense rates are
measured on the same data: every row against one weight (``dense fp8 all``: the weight stays in L2, the
rate item 2 compares with), and one cuBLAS GEMM per expert over its own rows and weight (``dense fp8 per
expert``: the same problem as the grouped kernel, as 64 dense calls), and ``dense fp8 step rows``: one
weight over the step's ``--tokens`` rows only, as the model's dense projections run. A configuration named
``*_fast`` accumulates as ``use_fast_accum=True`` does (what h200_fp8 runs) and
is compared with torch's fast kernel, ``*_exact`` with torch's exact one
(relative L2 of the outputs). Under the H200's power cap the clock drifts
as a run heats up, so every kernel is timed in each of ``--rounds`` rounds,
in turn, after a warm-up burn, and the median over the rounds is reported.

``--tokens`` sets the routed tokens (8194: an image step's rows; 1-64: a text
decode step's, where the GEMMs read a few experts' weights for a few rows and
the bandwidth of the weights read is the figure: ``weights GB/s``). A SwiGLU-epilogue build (``*_swiglu``) is
timed on gate_up only and checked against the SwiGLU of torch's product.

    python bench/bench_cutlass_grouped.py --lib a.so --lib b.so --json out.json
    python bench/bench_cutlass_grouped.py --lib a.so --tokens 1,32 --splits routed --chain 8
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit, round_robin_seconds  # noqa: E402

from omni.platforms.cuda.cutlass_grouped import CutlassGroupedFp8, exported_configs, swiglu_pairs  # noqa: E402

E, TOKENS, TOP_K = 64, 8194, 8
SHAPES = {"gate_up": (4096, 6144), "down": (3072, 4096)}
# The stack's own dense GEMM at these K and N over the step's tokens (an image step's qkv projection is gate_up's
# K and N over its 8194 rows): "this stack's dense fp8 GEMM" of issue 17's item 2, rated on its own rows.
STEP_DENSE = "dense fp8 step rows fast"


def call(kernel: CutlassGroupedFp8, xq, xs, wq, ws, offs, raster: int, swizzle: int):
    """A no-argument call of one configuration, writing one output that starts as NaN (unwritten stays NaN);
    a SwiGLU-epilogue build writes half the columns."""
    cols = wq.shape[1] // 2 if kernel.swiglu else wq.shape[1]
    out = torch.full((xq.shape[0], cols), float("nan"), dtype=torch.bfloat16, device="cuda")
    return lambda: kernel(xq, xs, wq, ws, offs, out=out, raster=raster, swizzle=swizzle)


def fp8(x):
    s = x.abs().amax(-1, keepdim=True).float() / 448
    return (x / s).to(torch.float8_e4m3fn), s


def splits(g, tokens: int = TOKENS):
    logits = torch.randn(tokens, E, device="cuda", generator=g)
    counts = torch.bincount(logits.topk(TOP_K, -1).indices.flatten(), minlength=E)
    one = torch.zeros(E, dtype=counts.dtype, device="cuda")
    one[0] = tokens * TOP_K  # every row to expert 0: the grouped kernel's machinery on the dense GEMM's problem
    return {"even": torch.full((E,), tokens * TOP_K // E, device="cuda"), "routed": counts, "one": one}


def dense_per_expert(xq, xs, wq, ws, counts):
    """One cuBLAS fp8 GEMM per expert over its rows: the grouped problem as dense calls (empty experts skipped).
    cuBLAS's row-wise scaled fp8 GEMM needs a multiple of 16 rows, so each expert's rows are copied into a
    block padded to one (zeros, at most 15 rows an expert: its rate is counted on the real rows only)."""
    n = counts.tolist()
    padded = [-(-c // 16) * 16 for c in n]
    starts, pstarts = [0, *torch.tensor(n).cumsum(0).tolist()], [0, *torch.tensor(padded).cumsum(0).tolist()]
    xq_p = torch.zeros(pstarts[-1], xq.shape[1], dtype=xq.dtype, device=xq.device)
    xs_p = torch.ones(pstarts[-1], dtype=xs.dtype, device=xs.device)
    for e, c in enumerate(n):
        xq_p[pstarts[e]: pstarts[e] + c] = xq[starts[e]: starts[e] + c]
        xs_p[pstarts[e]: pstarts[e] + c] = xs[starts[e]: starts[e] + c]
    parts = [(e, pstarts[e], pstarts[e + 1]) for e, c in enumerate(n) if c]
    return lambda: [torch._scaled_mm(xq_p[a:b], wq[e].t(), scale_a=xs_p[a:b].view(-1, 1),
                                     scale_b=ws[e].view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=True)
                    for e, a, b in parts]


def usable(fns: dict) -> dict:
    """The baselines that run on this problem (cuBLAS's row-wise fp8 GEMM refuses row counts that are not a
    multiple of 16, as a decode step's 8 rows); the others are reported as skipped."""
    out = {}
    for name, fn in fns.items():
        try:
            fn()
            out[name] = fn
        except RuntimeError as e:
            print(f"skipped {name}: {str(e).splitlines()[0][:120]}", flush=True)
    return out


def kernel_names(fn) -> list[str]:
    """The device kernels one call of ``fn`` launches (cuBLAS names carry its tile, cluster and schedule)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=Path, action="append", required=True)
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--chain", type=int, default=0, help="capture each kernel N times back to back into a CUDA "
                   "graph and time its replays (the sustained rate, as in a captured step); 0: eager calls")
    p.add_argument("--kernel-names", action="store_true", help="also name the kernels each call launches "
                   "(torch profiler): which cuBLAS kernel the dense rate comes from")
    p.add_argument("--splits", default="even,routed", help="row splits, comma-separated: even (1024 rows an "
                   "expert), routed (a top-8 routing of random tokens), one (every row to one expert: the dense "
                   "problem through the grouped kernel, telling its group handling from its tiles)")
    p.add_argument("--sched", default="M1", help="tile rasters and swizzles to try, comma-separated: M1,N1,M2,N4 "
                                                  "(M: along M, CUTLASS's default for groups; N: along N)")
    p.add_argument("--tokens", default=str(TOKENS), help="routed tokens (top-8 each), comma-separated: 8194 is "
                   "an image step's; 1-64 a text decode step's")
    a = p.parse_args()
    a.sched = [("MN".index(s[0]), int(s[1:])) for s in a.sched.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    kernels = [CutlassGroupedFp8(lib, name) for lib in a.lib for name in exported_configs(lib)]
    rows = []
    cases = [(t, split, counts) for t in map(int, a.tokens.split(",")) for split, counts in splits(g, t).items()]
    for tokens, split, counts in cases:
        if split not in a.splits.split(","):
            continue
        offs = counts.cumsum(0).to(torch.int32)
        R = int(offs[-1])
        for name, (k, n) in SHAPES.items():
            xq, xs = fp8(torch.randn(R, k, device="cuda", generator=g).bfloat16())
            wq, ws = fp8(torch.randn(E, n, k, device="cuda", generator=g).bfloat16())
            xs, ws = xs.view(-1).contiguous(), ws.view(E, n).contiguous()
            flops = 2 * R * k * n

            def torch_grouped(fast):
                return lambda: torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs, ws, offs=offs,
                                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

            fns = usable({"torch grouped fast": torch_grouped(True), "torch grouped exact": torch_grouped(False),
                          "dense fp8 all fast": lambda: torch._scaled_mm(
                              xq, wq[0].t(), scale_a=xs.view(-1, 1), scale_b=ws[0].view(1, -1),
                              out_dtype=torch.bfloat16, use_fast_accum=True),
                          "dense fp8 per expert fast": dense_per_expert(xq, xs, wq, ws, counts),
                          STEP_DENSE: lambda: torch._scaled_mm(
                              xq[:tokens], wq[0].t(), scale_a=xs[:tokens].view(-1, 1), scale_b=ws[0].view(1, -1),
                              out_dtype=torch.bfloat16, use_fast_accum=True)})
            ref = {acc: fns[f"torch grouped {acc}"]().float() for acc in ("fast", "exact")
                   if f"torch grouped {acc}" in fns}
            err = {}
            for kernel in kernels:
                if kernel.swiglu and name != "gate_up":  # the epilogue serves the first expert GEMM only
                    continue
                for raster, swizzle in a.sched:
                    label = kernel.config if (raster, swizzle) == (0, 1) else \
                        f"{kernel.config} r{'MN'[raster]}s{swizzle}"
                    fns[label] = ours = call(kernel, xq, xs, wq, ws, offs, raster, swizzle)
                    acc = "fast" if "_fast" in kernel.config else "exact"  # compared with torch's kernel of the same
                    if acc in ref:
                        want = swiglu_pairs(ref[acc]) if kernel.swiglu else ref[acc]
                        err[label] = float((ours().float() - want).norm() / want.norm())
            t = round_robin_seconds(fns, a.rounds, a.chain)
            weight_bytes = int((counts > 0).sum()) * n * k  # e4m3: the experts this split touches, read once
            row = {"tokens": tokens, "split": split, "gemm": name, "rows": R, "max_rows": int(counts.max()),
                   **{f"{m} TFLOP/s": round((2 * tokens * k * n if m == STEP_DENSE else flops) / s / 1e12, 1)
                      for m, s in t.items()},
                   **{f"{m} us": round(1e6 * s, 1) for m, s in t.items()},
                   **{f"{m} weights GB/s": round(weight_bytes / s / 1e9) for m, s in t.items()},
                   "rel err vs torch": err, "timing": f"graph of {a.chain} calls" if a.chain else "eager calls"}
            if a.kernel_names:
                row["kernels"] = {m: kernel_names(fn) for m, fn in fns.items()}
            print(row, flush=True)
            rows.append(row)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
