"""DeepGEMM's grouped fp8 GEMM (the ``sgl-deep-gemm`` wheel) against our CUTLASS build and the dense rate
(issue 17 item 2; a probe, not a platform kernel).

The index's ``deep-gemm`` is a source archive without its kernels; SGLang's fork ships a binary wheel
(``sgl-deep-gemm``, a 5 MB ``_C.so`` for CUDA 13 that JIT-compiles its kernels with the headers it carries).
Its sm90 grouped GEMM takes DeepGEMM's own formulation:
- the contiguous layout: each expert's rows padded to ``get_mk_alignment_for_contiguous_layout()`` rows, a row
  table naming each row's expert (-1 for padding);
- 1x128 activation scales and 128x128 weight scales, promoted into fp32 every 128-wide K block (its exact
  accumulation; there is no fast-accumulation mode on sm90).
Ours takes row-wise scales with fast accumulation (what ``h200_fp8`` runs). The rates count the routed rows
only (padding is work the kernel does, not the problem's), on the released MoE shapes (64 experts, top-8 of
8194 tokens: gate_up K 4096 -> N 6144, down K 3072 -> N 4096), with the even and routed splits of
``bench_cutlass_grouped.py``. Two dense yardsticks run in the same rounds: cuBLAS's row-wise fp8 GEMM over every
row against one weight (item 2's bar) and DeepGEMM's own dense GEMM on the same problem (its formulation's
dense rate). Each kernel is captured ``--chain`` times into a CUDA graph and the graphs are replayed round robin
(``bench_common.round_robin_seconds``), median over ``--rounds``. Quality: each output against the fp32 product
of the unquantized bf16 operands, over the first ``--check-experts`` experts' rows (relative L2).

    python bench/bench_deepgemm_grouped.py --json out.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit, round_robin_seconds  # noqa: E402
from bench_cutlass_grouped import E, SHAPES, fp8, splits  # noqa: E402


def padded_layout(counts_E, align: int):
    """DeepGEMM's contiguous layout of the routed rows: ``rows_M`` (each padded row's source row, -1 for padding)
    and ``expert_M`` (its expert, -1 for padding); every expert's block starts at a multiple of ``align``."""
    rows, experts, start = [], [], 0
    for e, c in enumerate(counts_E.tolist()):
        pad = -(-c // align) * align - c
        rows += list(range(start, start + c)) + [-1] * pad
        experts += [e] * c + [-1] * pad
        start += c
    return torch.tensor(rows, device="cuda"), torch.tensor(experts, dtype=torch.int32, device="cuda")


def deepgemm_operands(x_RK, w_ENK, rows_M):
    """x and w in DeepGEMM's sm90 formulation: 1x128 activation scales over the padded rows (zeros in the
    padding), 128x128 weight scales per expert."""
    from deep_gemm.utils.math import per_block_cast_to_fp8, per_token_cast_to_fp8

    x_MK = torch.zeros(rows_M.numel(), x_RK.shape[1], dtype=x_RK.dtype, device="cuda")
    x_MK[rows_M >= 0] = x_RK[rows_M[rows_M >= 0]]
    aq, as_ = per_token_cast_to_fp8(x_MK, use_ue8m0=False)
    n, k = w_ENK.shape[1:]
    bq, bs = per_block_cast_to_fp8(w_ENK.reshape(-1, k), use_ue8m0=False)
    return (aq, as_), (bq.view(E, n, k), bs.view(E, n // 128, k // 128))


def in_kernel_layout(dg, a, b):
    """The scales moved into the layout the kernel reads (MN-major, TMA-aligned) ahead of time, as a served
    layer would keep its weights' and write its activations': the timed call then converts nothing."""
    recipe, (m, k), (e, n) = (1, 128, 128), a[0].shape, b[0].shape[:2]
    return ((a[0], dg.transform_sf_into_required_layout(a[1], m, k, recipe, None, True)),
            (b[0], dg.transform_sf_into_required_layout(b[1], n, k, recipe, e, False)))


def reference_error(out_RN, x_RK, w_ENK, counts_E, experts: int) -> float:
    """Relative L2 of ``out_RN`` (routed row order) against the fp32 product of the bf16 operands over the first
    ``experts`` experts' rows."""
    got, want, start = [], [], 0
    for e, c in enumerate(counts_E.tolist()[:experts]):
        r = torch.arange(start, start + c, device="cuda")
        got.append(out_RN[r].float())
        want.append(x_RK[r].float() @ w_ENK[e].float().t())
        start += c
    got, want = torch.cat(got), torch.cat(want)
    return float((got - want).norm() / want.norm())


def cases(dg, cutlass, gemm: str, x_RK, w_ENK, counts_E, align: int):
    """The timed callables of one split and GEMM, each kernel's output after a first call (routed row order; the
    SwiGLU build's is SwiGLU(gate, up)), and DeepGEMM's padded row count."""
    xq, xs = fp8(x_RK)
    wq, ws = fp8(w_ENK)
    xs, ws = xs.view(-1).contiguous(), ws.view(E, -1).contiguous()
    offs = counts_E.cumsum(0).to(torch.int32)
    rows_M, expert_M = padded_layout(counts_E, align)
    a, b = in_kernel_layout(dg, *deepgemm_operands(x_RK, w_ENK, rows_M))
    d_MN = torch.empty(rows_M.numel(), w_ENK.shape[1], dtype=torch.bfloat16, device="cuda")
    d_one = torch.empty(rows_M.numel(), w_ENK.shape[1], dtype=torch.bfloat16, device="cuda")
    b_one = (b[0][0].contiguous(), b[1][0].contiguous())
    fns = {"deepgemm grouped": lambda: dg.m_grouped_fp8_gemm_nt_contiguous(a, b, d_MN, expert_M),
           "deepgemm dense one weight": lambda: dg.fp8_gemm_nt(a, b_one, d_one),
           "cublas dense one weight fast": lambda: torch._scaled_mm(
               xq, wq[0].t(), scale_a=xs.view(-1, 1), scale_b=ws[0].view(1, -1), out_dtype=torch.bfloat16,
               use_fast_accum=True)}
    cutlass = {name: k for name, k in cutlass.items() if not k.swiglu or gemm == "gate_up"}  # its epilogue's GEMM
    outs = {name: torch.empty(xq.shape[0], w_ENK.shape[1] // (2 if k.swiglu else 1), dtype=torch.bfloat16,
                              device="cuda") for name, k in cutlass.items()}
    for name, kernel in cutlass.items():
        fns[name] = (lambda k=kernel, o=outs[name]: k(xq, xs, wq, ws, offs, out=o))
    for fn in fns.values():
        fn()
    # padded_layout keeps the routed rows in order, so DeepGEMM's valid rows are its output in routed order
    return fns, {"deepgemm grouped": d_MN[rows_M >= 0], **outs}, rows_M.numel()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chain", type=int, default=8, help="calls captured back to back per graph (0: eager)")
    p.add_argument("--splits", default="even,routed")
    p.add_argument("--check-experts", type=int, default=4)
    a = p.parse_args()
    import deep_gemm as dg

    from omni.platforms.cuda import cutlass_grouped as cg

    nvcc, include = cg.find_nvcc(), cg.find_cutlass_include()
    cutlass = {"ours cutlass fast": cg.load(True, nvcc, include),  # the shipped down GEMM
               "ours cutlass fast swiglu": cg.load(True, nvcc, include, swiglu=True)} if nvcc and include else {}
    align = dg.get_mk_alignment_for_contiguous_layout()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for split, counts in splits(g).items():
        if split not in a.splits.split(","):
            continue
        R = int(counts.sum())
        for gemm, (k, n) in SHAPES.items():
            x_RK = torch.randn(R, k, device="cuda", generator=g).bfloat16()
            w_ENK = (torch.randn(E, n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
            fns, outs, padded = cases(dg, cutlass, gemm, x_RK, w_ENK, counts, align)
            err = {name: reference_error(o, x_RK, w_ENK, counts, a.check_experts) for name, o in outs.items()
                   if "swiglu" not in name}  # its output is SwiGLU(gate, up): bench_cutlass_grouped checks it
            t = round_robin_seconds(fns, a.rounds, a.chain)
            counted = {m: padded if m == "deepgemm dense one weight" else R for m in t}  # it multiplies every padded row
            row = {"split": split, "gemm": gemm, "rows": R, "padded_rows": padded, "align": align,
                   **{f"{m} TFLOP/s": round(2 * counted[m] * k * n / s / 1e12, 1) for m, s in t.items()},
                   **{f"{m} us": round(1e6 * s, 1) for m, s in t.items()},
                   "rel err vs bf16 product": {m: round(v, 5) for m, v in err.items()},
                   "timing": f"graph of {a.chain} calls" if a.chain else "eager calls"}
            print(row, flush=True)
            rows.append(row)
            del fns, outs
            torch.cuda.empty_cache()
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "deep_gemm": dg.__version__
                 if hasattr(dg, "__version__") else "?", "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
