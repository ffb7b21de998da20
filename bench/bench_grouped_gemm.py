"""Grouped FP8 expert GEMMs against the dense FP8 rate on the same shapes (issue 17 item 2).

The released MoE at one 1024x1024 CFG step: 8194 tokens x top 8 = 65,552
routed rows over 64 experts (about 1024 rows each, balanced here), gate_up
K 4096 -> N 6144 and down K 3072 -> N 4096. Timed in the same run:

    grouped fp8    torch._scaled_grouped_mm, e4m3 row-wise (what the cuda MoE runs)
    grouped fp8 fast  the same with use_fast_accum (kernels.fp8_fast_accum: 256x128 tiles, no fp32 promotion)
    grouped bf16   torch._grouped_mm
    dense fp8 1024 torch._scaled_mm on ONE expert's 1024 rows (the dense rate on these shapes)
    dense fp8 all  torch._scaled_mm on all 65,552 rows against one weight (the dense rate at full M)

TFLOP/s from CUDA-event medians. Accuracy: relative L2 of expert 0's bf16 output
against the fp32 product of the same dequantized e4m3 operands (so it measures the
accumulation and the bf16 rounding, not the quantization).

    python bench/bench_grouped_gemm.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_event_median  # noqa: E402

E, ROWS = 64, 1024
SHAPES = {"gate_up": (4096, 6144), "down": (3072, 4096)}


def rel(a, b) -> float:
    return float((a.float() - b).norm() / b.norm())


def fp8(x):
    s = x.abs().amax(-1, keepdim=True).float() / 448
    return (x / s).to(torch.float8_e4m3fn), s


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * ROWS
    rows = []
    for name, (k, n) in SHAPES.items():
        x = torch.randn(E * ROWS, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(E, n, k, device="cuda", generator=g).bfloat16()
        xq, xs = fp8(x)
        wq, ws = fp8(w)
        flops = 2 * E * ROWS * k * n

        def grouped(fast):
            return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs.view(-1), ws.view(E, n), offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)

        exact = (xq[:ROWS].float() * xs[:ROWS]) @ (wq[0].float() * ws[0]).t()
        err = {f"grouped fp8{' fast' if f else ''} rel err": rel(grouped(f)[:ROWS], exact) for f in (False, True)}

        def dense(rows: slice, **kw):  # cuBLAS over ``rows`` against expert 0's weight
            return torch._scaled_mm(xq[rows], wq[0].t(), scale_a=xs[rows], scale_b=ws[0].view(1, -1),
                                    out_dtype=torch.bfloat16, **kw)

        every = slice(None)
        t = {
            "grouped fp8": cuda_event_median(lambda: grouped(False)),
            "grouped fp8 fast": cuda_event_median(lambda: grouped(True)),
            "grouped bf16": cuda_event_median(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs,
                                                                        out_dtype=torch.bfloat16)),
            "dense fp8 1024": cuda_event_median(lambda: dense(slice(ROWS))) * E,
            "dense fp8 all": cuda_event_median(lambda: dense(every)),
            "dense fp8 all fast": cuda_event_median(lambda: dense(every, use_fast_accum=True)),
        }
        row = {"gemm": name, "K": k, "N": n, **{f"{m} TFLOP/s": round(flops / s / 1e12, 1) for m, s in t.items()},
               **{f"{m} ms": round(s * 1e3, 3) for m, s in t.items()}, **err}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "experts": E, "rows_per_expert": ROWS,
           "rows": rows}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
