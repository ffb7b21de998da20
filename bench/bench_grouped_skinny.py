"""The expert GEMMs of a decode step: the Triton grouped skinny kernel against our CUTLASS builds (issue 17).

At the released MoE shapes (64 experts; gate_up K 4096 -> N 6144 with the
SwiGLU epilogue, as the decode step runs it; down K 3072 -> N 4096) and the
row counts of ``--tokens`` decode tokens routed top-8 (``--routing``: by random
logits, or ``same``: every token to the same 8 experts, as identical prompts
decoded greedily route; the groups then hold as many rows as tokens), every
launch shape of ``--tiles`` of ``platforms/cuda/grouped_skinny_triton.py`` is
timed beside the CUTLASS builds given with ``--lib`` (the 128-row and 64-row
tiles, plain and SwiGLU epilogue) on the same operands. Each kernel is captured
``--chain`` times into a CUDA graph, alternating between ``--copies`` copies
of the experts' weights so that no call finds its weights in L2 (a step's
layers each read their own), and the graphs are replayed round robin.
Reported: microseconds per GEMM, the touched experts' weight bytes per second,
and each kernel's relative error against the fp64 product of the same e4m3
operands (the SwiGLU of it for the epilogue builds).

    python bench/bench_grouped_skinny.py --lib pong_64x128_c1x1_fast.so --lib pong_64x128_c1x1_fast_swiglu.so \\
        --tokens 1,8,32,64 --routing random,same --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import chained_seconds, emit, git_commit, relative  # noqa: E402
from bench_cutlass_grouped import E, SHAPES, TOP_K, fp8  # noqa: E402

from omni.platforms.cuda.cutlass_grouped import CutlassGroupedFp8, exported_configs, swiglu_pairs  # noqa: E402
from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8, GroupedSkinnyTile  # noqa: E402


def tiles(spec: str) -> list[GroupedSkinnyTile]:
    """``"16:32,64:256,512:4:3,4"`` -> every (block_m, block_n, block_k, warps, stages) of the lists."""
    parts = [list(map(int, p.split(","))) for p in spec.split(":")]
    return [GroupedSkinnyTile(*t[1:], block_m=t[0]) for t in itertools.product(*parts)]


def reference(xq, xs, wq, ws, counts, swiglu: bool) -> torch.Tensor:
    """The fp64 product of the e4m3 operands per expert group (and its SwiGLU of column pairs)."""
    out, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out.append((xq[start:start + c].double() * xs[start:start + c, None].double())
                       @ (wq[e].double() * ws[e, :, None].double()).T)
        start += c
    y = torch.cat(out)
    return swiglu_pairs(y) if swiglu else y


def alternating(kernel, xq, xs, weights, offs, cols: int, group_rows: int):
    """A no-argument call that multiplies by the next copy of the weights at each call (so a captured chain of
    calls reads them from memory, not L2), into one output; ``group_rows`` as the MoE passes it (its tokens)."""
    out = torch.empty(xq.shape[0], cols, dtype=torch.bfloat16, device="cuda")
    turn = itertools.cycle(weights)

    def run():
        wq, ws = next(turn)
        return kernel(xq, xs, wq, ws, offs, out=out, group_rows=group_rows)
    return run


def route(tokens: int, routing: str, g) -> torch.Tensor:
    """Rows per expert of ``tokens`` tokens routed top-8: by random logits, or all to experts 0-7 (``same``)."""
    if routing == "same":
        return torch.tensor([tokens] * TOP_K + [0] * (E - TOP_K), device="cuda")
    ids = torch.randn(tokens, E, device="cuda", generator=g).topk(TOP_K, -1).indices
    return torch.bincount(ids.flatten(), minlength=E)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=Path, action="append", default=[], help="CUTLASS objects to time beside")
    p.add_argument("--tokens", default="1,2,4,8,16,32,64")
    p.add_argument("--tiles", default="16,32,64:64:256:4:3,4", help="block_m list:block_n list:block_k list:"
                   "warps list:stages list (every combination is timed)")
    p.add_argument("--routing", default="random,same", help="comma-separated: random, same")
    p.add_argument("--chain", type=int, default=8)
    p.add_argument("--copies", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    cutlass = [CutlassGroupedFp8(lib, name) for lib in a.lib for name in exported_configs(lib)]
    rows = []
    cases = itertools.product(a.routing.split(","), map(int, a.tokens.split(",")), SHAPES.items())
    for routing, tokens, (gemm, (K, N)) in cases:
        swiglu = gemm == "gate_up"  # the decode step's GEMM 1 runs the SwiGLU epilogue
        counts = route(tokens, routing, g)
        offs, R = counts.cumsum(0).to(torch.int32), tokens * TOP_K
        xq, xs = fp8(torch.randn(R, K, device="cuda", generator=g).bfloat16())
        xs = xs.view(-1).contiguous()
        weights = []
        for _ in range(a.copies):
            wq, ws = fp8(torch.randn(E, N, K, device="cuda", generator=g).bfloat16())
            weights.append((wq, ws.view(E, N).contiguous()))
        ref = reference(xq, xs, *weights[0], counts, swiglu)
        cols = N // 2 if swiglu else N
        kernels = {k.config: k for k in cutlass if k.swiglu == swiglu}
        for t in tiles(a.tiles):
            k = GroupedSkinnyFp8(R, swiglu, tiles=((R, t),))  # every call fits: the tile alone is timed
            if k.fits(xq, weights[0][0], group_rows=tokens):
                kernels[k.config] = k
        fns, err = {}, {}
        for name, k in kernels.items():
            try:
                err[name] = relative(k(xq, xs, *weights[0], offs, group_rows=tokens), ref)
            except Exception as e:  # a launch shape over the shared memory (triton's OutOfResources)
                print(f"skipped {name}: {type(e).__name__}", flush=True)
                continue
            fns[name] = alternating(k, xq, xs, weights, offs, cols, tokens)
        us = {n: s * 1e6 for n, s in chained_seconds(fns, a.chain, a.rounds, burn=20, iters=5).items()}
        touched = int((counts > 0).sum()) * N * K
        best = min(us, key=us.get)
        row = {"routing": routing, "tokens": tokens, "rows": R, "gemm": gemm, "max_rows": int(counts.max()),
               "experts": int((counts > 0).sum()),
               "us": {n: round(v, 2) for n, v in us.items()},
               "weights TB/s": {n: round(touched / v / 1e6, 2) for n, v in us.items()},
               "rel err vs fp64": err, "best": best}
        print({k: row[k] for k in ("routing", "tokens", "gemm", "best")}, round(us[best], 2),
              {n: round(v, 1) for n, v in us.items() if not n.startswith("triton")}, flush=True)
        rows.append(row)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "chain": a.chain, "copies": a.copies,
                 "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
