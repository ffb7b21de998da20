"""The MoE's counting sort at decode sizes: its launch plans against each other (issue 17).

A decode step routes top-8 of 64 experts for each answer's one token: 8 to
512 assignments and more. ``TritonKernels.route_rows`` launches the sort by one
of ``ROUTE_PLANS`` (``route_plan`` picks by the row count): ``one launch`` (one
program sorts them all), ``chunks`` (count and place kernels, a program per
128 rows) or ``blocks`` (a program per 1024 rows, a chunk at a time). Every
plan runs on the same ids, each captured ``--chain`` times into a CUDA graph
(as the decode step is) and replayed round robin; the medians are reported
with the outputs checked equal to the torch sort's.

    python bench/bench_route_rows.py --tokens 1,8,32,64,128 --json out.json

``--against MODULE`` also times another build of the sort on the same ids in the same round robin: a module
that defines ``TritonKernels`` (e.g. a copy of an earlier ``moe_triton.py`` placed beside it as
``omni.platforms.cuda.moe_triton_before``); its figures are the ``<plan> us (against)`` columns.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import chained_seconds, emit, git_commit  # noqa: E402

from omni.platforms.cuda.moe import TorchKernels  # noqa: E402
from omni.platforms.cuda.moe_triton import TritonKernels  # noqa: E402
from omni.platforms.cuda.route_launch import ROUTE_PLANS, route_plan  # noqa: E402

E, TOP_K = 64, 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,8,32,64,128,512", help="tokens routed (top-8 of 64 each), comma-separated")
    p.add_argument("--chain", type=int, default=32, help="sorts per captured graph (a step's layers)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--against", metavar="MODULE", help="another module's TritonKernels, timed alongside")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    kernels, ref = TritonKernels(), TorchKernels()
    other = importlib.import_module(a.against).TritonKernels() if a.against else None
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for tokens in map(int, a.tokens.split(",")):
        ids = torch.rand(tokens, E, device="cuda", generator=g).topk(TOP_K, -1).indices
        want = ref.route_rows(ids, E)
        plans = [p for p in ROUTE_PLANS if p != "one launch" or tokens * TOP_K <= 1024]
        builds = {"": kernels, **({" (against)": other} if other is not None else {})}
        equal = {f"{p}{tag}": all(torch.equal(x, y) for x, y in zip(k.route_rows(ids, E, plan=p), want))
                 for tag, k in builds.items() for p in plans}
        sorts = {f"{p} us{tag}": (lambda k=k, p=p: k.route_rows(ids, E, plan=p)) for tag, k in builds.items()
                 for p in plans}
        t = chained_seconds(sorts, a.chain, a.rounds, burn=20, iters=5)
        row = {"tokens": tokens, "assignments": tokens * TOP_K, "chosen": route_plan(tokens * TOP_K),
               **{name: round(1e6 * s, 2) for name, s in t.items()}, "equal to the torch sort": equal}
        row["chosen vs blocks"] = round(row["blocks us"] / row[f"{row['chosen']} us"], 2)
        print(row, flush=True)
        rows.append(row)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "chain": a.chain, "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
