"""Work per clock and energy per FLOP: the grouped fp8 expert GEMM against the dense fp8 GEMM under the power cap.

Issue 17's item 2 compares the grouped expert GEMMs with the dense fp8 rate of the same run. Under the H200's
700 W cap the SM clock follows the power a kernel draws, so a rate mixes two things: how much the kernel does
per clock cycle, and how much energy each FLOP costs (which sets the clock the cap allows). This bench runs
each kernel alone for ``--seconds`` (a graph of ``--chain`` calls replayed back to back, as a captured step
runs it), samples ``nvidia-smi`` (SM clock, board power) every ``--sample-ms`` meanwhile, and reports for each:

    TFLOP/s          FLOPs done / wall time of the window
    SM MHz, W        means of the samples inside the window
    TFLOP per GHz    TFLOP/s / (SM MHz / 1000): work per clock, the kernel's own efficiency
    pJ / FLOP        W / (TFLOP/s): energy per FLOP, what the cap turns into clock

Kernels (released MoE shapes, the shipped builds from the kernel cache): cuBLAS's dense fp8 GEMM over the even
split's 65,536 rows against one weight (``dense``, the rate item 2 compares with), our CUTLASS grouped kernel on
the even split (1024 rows an expert) and the routed one (a top-8 routing of 8194 random tokens, 65,552 rows), and
for gate_up the shipped SwiGLU-epilogue build. The kernels alternate over ``--rounds`` rounds so none owns the cool
start.

    python bench/bench_gemm_clocks.py --lib a.so --lib b_swiglu.so --json out.json
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import captured, emit, git_commit  # noqa: E402
from bench_cutlass_grouped import E, SHAPES, call, fp8, splits  # noqa: E402

from omni.platforms.cuda.cutlass_grouped import CutlassGroupedFp8, exported_configs  # noqa: E402


class Sampler:
    """``nvidia-smi`` in loop mode on its own thread: (monotonic time, SM MHz, W) samples until stopped."""

    def __init__(self, sample_ms: int):
        cmd = ["nvidia-smi", "-i", str(torch.cuda.current_device()), "--query-gpu=clocks.sm,power.draw",
               "--format=csv,noheader,nounits", f"-lms={sample_ms}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.samples: list[tuple[float, float, float]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                mhz, watts = (float(v) for v in line.split(","))
            except ValueError:  # a "[N/A]" or a partial line
                continue
            self.samples.append((time.monotonic(), mhz, watts))

    def between(self, t0: float, t1: float) -> tuple[float, float, int]:
        inside = [(m, w) for t, m, w in self.samples if t0 <= t <= t1]
        if not inside:
            raise RuntimeError("nvidia-smi gave no sample inside the window: raise --seconds or lower --sample-ms")
        return statistics.fmean(m for m, _ in inside), statistics.fmean(w for _, w in inside), len(inside)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def window(graph: torch.cuda.CUDAGraph, seconds: float) -> tuple[float, float, int]:
    """Replay ``graph`` for about ``seconds`` after a one-second warm-up; (start, end, replays) of the timed part."""
    torch.cuda.synchronize()
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        graph.replay()
        torch.cuda.synchronize()
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        graph.replay()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()  # keep the host near the device, so the window's end is the device's
    torch.cuda.synchronize()
    return t0, time.monotonic(), n


def cases(a, g) -> list[tuple[str, str, int, Callable[[], object]]]:
    """(gemm, kernel label, FLOPs a call, call) for every kernel at both shapes."""
    kernels = [CutlassGroupedFp8(lib, name) for lib in a.lib for name in exported_configs(lib)]
    out = []
    split_counts = splits(g)
    for gemm, (k, n) in SHAPES.items():
        wq, ws = fp8(torch.randn(E, n, k, device="cuda", generator=g).bfloat16())
        ws = ws.view(E, n).contiguous()
        for split in ("even", "routed"):
            offs = split_counts[split].cumsum(0).to(torch.int32)
            R = int(offs[-1])
            xq, xs = fp8(torch.randn(R, k, device="cuda", generator=g).bfloat16())
            xs = xs.view(-1).contiguous()
            if split == "even":
                def dense(xq=xq, xs=xs, w=wq[0], s=ws[0]):  # this shape's own weight, bound now
                    return torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=s.view(1, -1),
                                            out_dtype=torch.bfloat16, use_fast_accum=True)
                out.append((gemm, "dense (cuBLAS, one weight)", 2 * R * k * n, dense))
            for kernel in kernels:
                if kernel.swiglu and gemm != "gate_up":
                    continue
                out.append((gemm, f"{kernel.config} {split}", 2 * R * k * n, call(kernel, xq, xs, wq, ws, offs, 0, 1)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=Path, action="append", required=True, help="a CUTLASS grouped build (.so)")
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per kernel and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chain", type=int, default=8, help="calls captured into the graph that is replayed")
    p.add_argument("--sample-ms", type=int, default=50)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    todo = [(gemm, label, flops, captured(fn, a.chain)) for gemm, label, flops, fn in cases(a, g)]
    sampler = Sampler(a.sample_ms)
    per: dict[tuple[str, str], list[dict]] = {}
    try:
        for _ in range(a.rounds):
            for gemm, label, flops, graph in todo:
                t0, t1, n = window(graph, a.seconds)
                mhz, watts, samples = sampler.between(t0, t1)
                tflops = flops * a.chain * n / (t1 - t0) / 1e12
                per.setdefault((gemm, label), []).append(
                    {"tflops": tflops, "sm_mhz": mhz, "watts": watts, "samples": samples})
                print(f"{gemm:8s} {label:42s} {tflops:7.1f} TFLOP/s  {mhz:6.0f} MHz  {watts:5.0f} W  "
                      f"{tflops / mhz * 1e3:6.1f} TFLOP/GHz  {watts / tflops:5.3f} pJ/FLOP", flush=True)
    finally:
        sampler.stop()
    rows = []
    for (gemm, label), runs in per.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("tflops", "sm_mhz", "watts")}
        rows.append({"gemm": gemm, "kernel": label, **{k: round(v, 1) for k, v in med.items()},
                     "tflop_per_ghz": round(med["tflops"] / med["sm_mhz"] * 1e3, 1),
                     "pj_per_flop": round(med["watts"] / med["tflops"], 4), "rounds": runs})
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "chain": a.chain,
                 "seconds": a.seconds, "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
