"""Our CUTLASS builds of the grouped fp8 expert GEMM against torch._scaled_grouped_mm (issue 17 item 2).

Every configuration exported by the shared objects given (built from
platforms/cuda/csrc/grouped_fp8.cu) is timed beside torch's kernel and the
dense fp8 rate on the same data, at the released MoE shapes (64 experts,
65,552 routed rows: gate_up K 4096 -> N 6144, down K 3072 -> N 4096), with
two row splits: exactly 1024 rows per expert, and the counts of a top-8
routing of 8194 random tokens (uneven, as served). A configuration named
``*_fast`` accumulates as ``use_fast_accum=True`` does (what h200_fp8 runs) and
is compared with torch's fast kernel, ``*_exact`` with torch's exact one
(relative L2 of the outputs). Under the H200's power cap the clock drifts
as a run heats up, so every kernel is timed in each of ``--rounds`` rounds,
in turn, after a warm-up burn, and the median over the rounds is reported.

    python bench/bench_cutlass_grouped.py --lib a.so --lib b.so --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_event_median, emit, git_commit  # noqa: E402

E, TOKENS, TOP_K = 64, 8194, 8
SHAPES = {"gate_up": (4096, 6144), "down": (3072, 4096)}


def configs(path: Path):
    """(name, run, scratch) of every configuration a shared object exports."""
    lib = ctypes.CDLL(str(path))
    names = re.findall(rb"omni_gg_(\w+?)_run\x00", path.read_bytes())
    out = []
    for n in sorted(set(names)):
        run = getattr(lib, f"omni_gg_{n.decode()}_run")
        run.restype = ctypes.c_int
        run.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 2
        scratch = getattr(lib, f"omni_gg_{n.decode()}_scratch")
        scratch.restype, scratch.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_int]
        out.append((n.decode(), run, scratch))
    return out


def ctypes_call(run, scratch, xq, wq, xs, ws, offs, n, k, sms, stream, raster=0, swizzle=1):
    """A no-argument call of one exported configuration that returns its output."""
    buf = torch.empty(scratch(E, sms), dtype=torch.uint8, device="cuda")
    out = torch.full((xq.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")  # unwritten stays NaN

    def call():
        rc = run(xq.data_ptr(), wq.data_ptr(), out.data_ptr(), xs.data_ptr(), ws.data_ptr(), offs.data_ptr(),
                 E, n, k, sms, raster, swizzle, buf.data_ptr(), stream)
        assert rc == 0, f"status {rc}"
        return out
    return call


def round_robin(fns: dict, rounds: int) -> dict:
    """Median seconds of each function over ``rounds`` rounds in which every one is timed in turn."""
    burn = next(iter(fns.values()))
    for _ in range(200):  # reach the power cap's steady clock before anything is timed
        burn()
    per = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per[name].append(cuda_event_median(fn, iters=10, warmup=1))
    return {name: statistics.median(ts) for name, ts in per.items()}


def fp8(x):
    s = x.abs().amax(-1, keepdim=True).float() / 448
    return (x / s).to(torch.float8_e4m3fn), s


def splits(g):
    logits = torch.randn(TOKENS, E, device="cuda", generator=g)
    counts = torch.bincount(logits.topk(TOP_K, -1).indices.flatten(), minlength=E)
    return {"even": torch.full((E,), TOKENS * TOP_K // E, device="cuda"), "routed": counts}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=Path, action="append", required=True)
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--sched", default="M1", help="tile rasters and swizzles to try, comma-separated: M1,N1,M2,N4 "
                                                  "(M: along M, CUTLASS's default for groups; N: along N)")
    a = p.parse_args()
    a.sched = [("MN".index(s[0]), int(s[1:])) for s in a.sched.split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    kernels = [c for lib in a.lib for c in configs(lib)]
    rows = []
    for split, counts in splits(g).items():
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

            ref = {acc: torch_grouped(acc == "fast")().float() for acc in ("fast", "exact")}
            fns = {"torch grouped fast": torch_grouped(True), "torch grouped exact": torch_grouped(False),
                   "dense fp8 all fast": lambda: torch._scaled_mm(
                       xq, wq[0].t(), scale_a=xs.view(-1, 1), scale_b=ws[0].view(1, -1), out_dtype=torch.bfloat16,
                       use_fast_accum=True)}
            err = {}
            for cname, run, scratch in kernels:
                for raster, swizzle in a.sched:
                    label = cname if (raster, swizzle) == (0, 1) else f"{cname} r{'MN'[raster]}s{swizzle}"
                    fns[label] = ours = ctypes_call(run, scratch, xq, wq, xs, ws, offs, n, k, sms, stream, raster,
                                                    swizzle)
                    out = ours()
                    err[label] = float((out.float() - ref[cname.rsplit("_", 1)[1]]).norm() / ref["fast"].norm())
                    out.fill_(float("nan"))  # the next call must write every element again
            t = round_robin(fns, a.rounds)
            row = {"split": split, "gemm": name, "rows": R, "max_rows": int(counts.max()),
                   **{f"{m} TFLOP/s": round(flops / s / 1e12, 1) for m, s in t.items()},
                   "rel err vs torch": err}
            print(row, flush=True)
            rows.append(row)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
