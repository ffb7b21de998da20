"""Does a PLAIN CUTLASS sm90 fp8 GEMM reach cuBLAS's rate on the MoE shapes? (a diagnostic probe)

Our grouped ptr-array kernel (platforms/cuda/csrc/grouped_fp8.cu) runs the
dense problem (every row in one group, bench/bench_cutlass_grouped.py
``--splits one``) below cuBLAS's dense fp8 rate. This tells whether the gap is
CUTLASS's sm90 kernel itself (its tiles, its pipeline depth) or the grouped
machinery around it: bench/csrc/dense_fp8_probe.cu builds CUTLASS's plain
(non-grouped, non-ptr-array) warp-specialized fp8 GEMM with the same epilogue
(bf16((acc * scale_a[row]) * scale_b[col])) and fast accumulation, in three
configurations (ping-pong 128x128 in 1x2 and 2x1 clusters, cooperative
128x256 in 2x1), and times each beside torch._scaled_mm (cuBLAS,
use_fast_accum=True) and, with ``--grouped-lib``, every configuration of a
grouped object with all rows in expert 0 of 64. Shapes: M = 65,552 rows (``--rows``),
gate_up K 4096 -> N 6144 and down K 3072 -> N 4096 (``--shapes``; also the layer's dense GEMMs at 8194 rows:
qkv, o_proj, shared_down), random e4m3 operands with
per-row fp32 scales. Reported: TFLOP/s (2 M N K / seconds a call; the median
over ``--rounds`` round-robin rounds of replays of ``--chain`` captured calls,
as bench/bench_cutlass_grouped.py times), the relative L2 error of every
output against cuBLAS's, and each plain configuration's mainloop stage count.

The object is compiled with nvcc (about 1-2 minutes, needs no GPU) into
``$OMNI_KERNEL_CACHE`` (default: omni-kernels under the system temp folder),
keyed by the source, the nvcc version and the CUTLASS headers, and reused;
``--lib`` takes a built one, ``--build-only`` only builds (or finds) it.

    python bench/bench_cutlass_dense.py --build-only
    python bench/bench_cutlass_dense.py --lib dense.so --grouped-lib grouped.so --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cutlass_probe import probe_configs, probe_library  # noqa: E402
from bench_common import emit, git_commit, round_robin_seconds  # noqa: E402
from bench_cutlass_grouped import call, fp8  # noqa: E402

from omni.platforms.cuda.cutlass_grouped import CutlassGroupedFp8, exported_configs  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "csrc" / "dense_fp8_probe.cu"
E = 64  # the grouped kernel's groups: every row in group 0
M = 65552  # the released MoE's routed rows (8194 tokens x top 8)
# name: (K, N): the MoE's expert GEMMs, and the layer's dense ones (qkv_proj and the shared expert's gate_up are
# both 4096 -> 6144) at ``--rows 8194`` (one 1024x1024 CFG step's tokens)
SHAPES = {"gate_up": (4096, 6144), "down": (3072, 4096), "qkv": (4096, 6144), "o_proj": (4096, 4096),
          "shared_down": (3072, 4096)}


def dense_configs(library: Path) -> list[str]:
    return probe_configs(library, "omni_dp")


class DenseFp8:
    """One exported configuration: ``D[M, N] = bf16((A[M, K] @ B[N, K]^T) * sa[m] * sb[n])``, e4m3 in."""

    def __init__(self, lib: ctypes.CDLL, config: str):
        self.config = config
        self._run = getattr(lib, f"omni_dp_{config}_run")
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 2
        self._scratch = getattr(lib, f"omni_dp_{config}_scratch")
        self._scratch.restype, self._scratch.argtypes = ctypes.c_size_t, [ctypes.c_int] * 4
        stages = getattr(lib, f"omni_dp_{config}_stages")
        stages.restype, stages.argtypes = ctypes.c_int, []
        self.stages = stages()

    def call(self, xq, xs, wq, ws):
        """A no-argument call writing one output that starts as NaN (unwritten stays NaN), scratch allocated once."""
        (m, k), n = xq.shape, wq.shape[0]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        scratch = torch.empty(max(self._scratch(m, n, k, sms), 256), dtype=torch.uint8, device="cuda")
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")

        def fn():
            status = self._run(xq.data_ptr(), wq.data_ptr(), out.data_ptr(), xs.data_ptr(), ws.data_ptr(), m, n, k,
                               sms, scratch.data_ptr(), torch.cuda.current_stream().cuda_stream)
            if status:
                raise RuntimeError(f"{self.config}: CUTLASS refused the call (status {status}: 1 cannot implement, "
                                   f"2 initialize, 3 run, 4 launch error) for M={m} N={n} K={k}")
            return out

        return fn


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=Path, help="the probe's built shared object (default: build it, or find it in "
                   "the cache)")
    p.add_argument("--grouped-lib", type=Path, action="append", default=[],
                   help="a grouped_fp8 shared object: time its every configuration on the same problem, all rows "
                   "in expert 0 of 64 (repeatable; default: none)")
    p.add_argument("--build-only", action="store_true", help="only build (or find) the probe object and print its "
                   "path (no GPU needed)")
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chain", type=int, default=8, help="capture each kernel N times back to back into a CUDA "
                   "graph and time its replays (the sustained rate, as in a captured step); 0: eager calls")
    p.add_argument("--shapes", default="gate_up,down", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--rows", type=int, default=M, help="M: the routed rows (default) or a step's tokens (8194)")
    a = p.parse_args()

    lib_path = probe_library(SOURCE, a.lib)
    if a.build_only:
        print(lib_path)
        try:  # the stage counts, when the object opens here (a host function: no GPU needed)
            lib = ctypes.CDLL(str(lib_path))
            print({d: DenseFp8(lib, d).stages for d in dense_configs(lib_path)}, file=sys.stderr)
        except OSError as e:
            print(f"(stage counts not read: {e})", file=sys.stderr)
        return 0

    lib = ctypes.CDLL(str(lib_path))
    dense = [DenseFp8(lib, name) for name in dense_configs(lib_path)]
    grouped = [CutlassGroupedFp8(gl, name) for gl in a.grouped_lib for name in exported_configs(gl)]
    stages = {f"cutlass dense {d.config}": d.stages for d in dense}
    print({"library": str(lib_path), "stages": stages}, flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        k, n = SHAPES[name]
        xq, xs = fp8(torch.randn(a.rows, k, device="cuda", generator=g).bfloat16())
        wq, ws = fp8(torch.randn(n, k, device="cuda", generator=g).bfloat16())
        xs, ws = xs.view(-1).contiguous(), ws.view(-1).contiguous()
        flops = 2 * a.rows * n * k

        def cublas():
            return torch._scaled_mm(xq, wq.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                    out_dtype=torch.bfloat16, use_fast_accum=True)

        fns = {"cublas _scaled_mm fast": cublas}
        for d in dense:
            fns[f"cutlass dense {d.config}"] = d.call(xq, xs, wq, ws)
        if grouped:
            # expert 0's weight is the dense one; the other 63 get no rows (zeros: never read into an output)
            wq_e = torch.zeros(E, n, k, dtype=torch.uint8, device="cuda")
            wq_e[0] = wq.view(torch.uint8)
            wq_e = wq_e.view(torch.float8_e4m3fn)
            ws_e = torch.zeros(E, n, device="cuda")
            ws_e[0] = ws
            offs = torch.full((E,), a.rows, dtype=torch.int32, device="cuda")  # cumulative ends: all rows in group 0
            for kernel in grouped:
                fns[f"cutlass grouped {kernel.config}"] = call(kernel, xq, xs, wq_e, ws_e, offs, 0, 1)
        ref = cublas().float()
        err = {}
        for label, fn in fns.items():
            if label != "cublas _scaled_mm fast":
                err[label] = float((fn().float() - ref).norm() / ref.norm())
        torch.cuda.synchronize()
        t = round_robin_seconds(fns, a.rounds, a.chain)
        row = {"gemm": name, "M": a.rows, "N": n, "K": k,
               **{f"{label} TFLOP/s": round(flops / s / 1e12, 1) for label, s in t.items()},
               "rel err vs cublas": err, "stages": stages,
               "timing": f"graph of {a.chain} calls" if a.chain else "eager calls"}
        print(row, flush=True)
        rows.append(row)
        del fns, ref
        torch.cuda.empty_cache()
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "library": str(lib_path),
                 "grouped libraries": [str(gl) for gl in a.grouped_lib], "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
