"""quack-kernels' grouped (varlen-M) fp8 GEMM against our CUTLASS grouped kernel and the dense rate (issue 17).

quack-kernels (CuTe-DSL kernels, one of the libraries issue 17 names) runs a
grouped GEMM as one persistent kernel over the routed rows, split by their
cumulative group ends (``cu_seqlens_m``): the layout our ptr-array kernel
(platforms/cuda/csrc/grouped_fp8.cu) takes, with another tile scheduler and
mainloop. It can also gather the rows inside the GEMM (``A_idx``), which
would take our separate row gather (about 0.11 ms a layer) out of the step.

Its SM90 fp8 GEMM scales by one scalar (``alpha``): it has no row-wise
scales. So this is a probe of its mainloop and scheduler on our problem, not
a drop-in kernel: each quack configuration is timed on the routed rows at the
released MoE shapes (as bench/bench_cutlass_grouped.py: gate_up K 4096 -> N
6144, down K 3072 -> N 4096, 64 experts, 8194 tokens x top 8), beside our
shipped builds (row-wise scales in their epilogue) and cuBLAS's dense fp8
GEMM over the same rows (the rate item 2 compares with). Correctness: each
quack output against our kernel's with unit scales (the same e4m3 product;
relative L2). CUDA-graph replays of ``--chain`` calls, round robin over
``--rounds`` rounds; a configuration that fails to compile, run or capture is
reported with its error and left out.

    python bench/bench_quack_grouped.py --lib pong_128x128.so --lib pong_128x192_swiglu.so --json out.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit, relative, round_robin_seconds  # noqa: E402
from bench_cutlass_grouped import E, SHAPES, TOKENS, TOP_K, call, fp8, splits  # noqa: E402

from omni.platforms.cuda.cutlass_grouped import CutlassGroupedFp8, exported_configs  # noqa: E402

# name -> (tile_m, tile_n, pingpong, cluster_m, cluster_n): quack's SM90 default family and ours
CONFIGS = {"pong_128x192_c2x1": (128, 192, True, 2, 1), "pong_128x128_c1x2": (128, 128, True, 1, 2),
           "pong_128x192_c1x2": (128, 192, True, 1, 2), "coop_256x128_c2x1": (256, 128, False, 2, 1),
           "pong_128x192_c1x1": (128, 192, True, 1, 1)}


def register_fp8() -> None:
    """quack-kernels 0.4.1's torch -> CuTe dtype map has no e4m3 entry, though its SM90 GEMM takes e4m3 operands
    (its docstring and dtype checks): the probe adds the entry."""
    import cutlass
    from quack import cute_dsl_utils

    cute_dsl_utils.torch2cute_dtype_map.setdefault(torch.float8_e4m3fn, cutlass.Float8E4M3FN)


def quack_config(name: str):
    """``name`` from CONFIGS; a suffix ``_k128`` sets tile_k (128 e4m3 elements: one 128-byte row of K)."""
    from quack.gemm_config import GemmConfig

    base, _, k = name.partition("_k")
    tm, tn, pong, cm, cn = CONFIGS[base]
    return GemmConfig(tile_m=tm, tile_n=tn, tile_k=int(k) if k else None, pingpong=pong, cluster_m=cm,
                      cluster_n=cn, is_dynamic_persistent=False, device_capacity=9)


def quack_call(cfg, xq, wq, offs, gather=None, dense: bool = False):
    """One varlen-M call writing one bf16 output; ``gather``: (the unsorted e4m3 token rows, each routed row's
    token index), gathered inside the GEMM; ``dense``: every row against expert 0's weight, no groups (quack's
    plain GEMM on the dense problem: its rate apart from the groups)."""
    from quack.gemm_interface import gemm_tuned

    cu = torch.cat([offs.new_zeros(1), offs]).to(torch.int32)
    b_EKN = wq.transpose(1, 2)  # [E, K, N] viewed K-major: quack's fp8 needs K-major operands
    out = torch.empty(int(offs[-1]), wq.shape[1], dtype=torch.bfloat16, device=xq.device)
    a, idx = (xq, None) if gather is None else gather

    def run():
        if dense:
            gemm_tuned.fn(a, b_EKN[0], out, config=cfg)
        else:
            gemm_tuned.fn(a, b_EKN, out, cu_seqlens_m=cu, A_idx=idx, config=cfg)
        return out
    return run


def quack_candidates(a, xq, wq, offs, ref, token_rows):
    """name -> call for every configuration that compiles, runs and matches ``ref``; errors by name."""
    fns, notes = {}, {}
    names = a.configs.split(",")
    runs = [(n, None) for n in names] + [(f"{n} gather", token_rows) for n in a.gather.split(",") if n] + \
        [(f"{n} dense", None) for n in a.dense.split(",") if n] + [(f"{n} bf16", None) for n in a.bf16.split(",") if n]
    dense_ref = xq.double() @ wq[0].double().T  # the dense problem's product (every row, expert 0)
    for label, gather in runs:
        try:
            t0 = time.monotonic()
            x_, w_ = (xq.bfloat16(), wq.bfloat16()) if label.endswith("bf16") else (xq, wq)
            fn = quack_call(quack_config(label.split()[0]), x_, w_, offs, gather, dense=label.endswith("dense"))
            out = fn()
            torch.cuda.synchronize()
            want = dense_ref if label.endswith("dense") else ref
            notes[label] = {"first_call_s": round(time.monotonic() - t0, 1), "rel_err": relative(out, want)}
            fns[f"quack {label}"] = fn
        except Exception as e:  # noqa: BLE001 - a probe: report what failed and go on
            import traceback

            where = traceback.extract_tb(e.__traceback__)[-1]
            notes[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                            "at": f"{Path(where.filename).name}:{where.lineno}"}
        print(label, notes[label], flush=True)
    return fns, notes


def routed_token_rows(counts, tokens: int, g):
    """The routed rows' token indices for ``counts`` (each expert's rows drawn from the tokens, sorted by
    expert): what the MoE's gather reads."""
    return torch.cat([torch.randperm(tokens, device="cuda", generator=g)[:c] for c in counts.tolist()]).to(torch.int32)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=Path, action="append", default=[], help="our CUTLASS objects to time beside it")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"quack configurations: {', '.join(CONFIGS)}")
    p.add_argument("--gather", default="pong_128x192_c1x1", help="configurations also timed with the row gather "
                   "inside the GEMM (A_idx; quack needs cluster_n 1 for it); empty: none")
    p.add_argument("--dense", default="", help="configurations also timed on the dense problem (every row, one "
                   "weight, no groups)")
    p.add_argument("--bf16", default="", help="configurations also timed with bf16 operands (quack's main path)")
    p.add_argument("--splits", default="routed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chain", type=int, default=8)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import quack

    register_fp8()
    g = torch.Generator(device="cuda").manual_seed(0)
    ours = [CutlassGroupedFp8(lib, name) for lib in a.lib for name in exported_configs(lib)]
    rows = []
    for split, counts in splits(g).items():
        if split not in a.splits.split(","):
            continue
        offs = counts.cumsum(0).to(torch.int32)
        R = int(offs[-1])
        for gemm, (k, n) in SHAPES.items():
            x = torch.randn(TOKENS, k, device="cuda", generator=g).bfloat16()
            idx = routed_token_rows(counts, TOKENS, g)
            xq_tok, xs_tok = fp8(x)
            xq, xs = xq_tok[idx.long()].contiguous(), xs_tok[idx.long()].view(-1).contiguous()
            wq, ws = fp8(torch.randn(E, n, k, device="cuda", generator=g).bfloat16())
            ws = ws.view(E, n).contiguous()
            plain = [kern for kern in ours if not kern.swiglu]
            if not plain:
                raise SystemExit("give --lib with a plain (not SwiGLU) build of ours: it is the reference")
            ref = plain[0](xq, torch.ones_like(xs), wq, torch.ones_like(ws), offs).double()
            fns, notes = quack_candidates(a, xq, wq, offs, ref, (xq_tok, idx))
            xq_bf, wq_bf = xq.bfloat16(), wq.bfloat16()
            for kern in ours:
                if kern.swiglu and gemm != "gate_up":
                    continue
                fns[f"ours {kern.config}"] = call(kern, xq, xs, wq, ws, offs, 0, 1)
            fns["dense bf16 all"] = lambda: xq_bf @ wq_bf[0].T
            fns["dense fp8 all fast"] = lambda: torch._scaled_mm(
                xq, wq[0].t(), scale_a=xs.view(-1, 1), scale_b=ws[0].view(1, -1), out_dtype=torch.bfloat16,
                use_fast_accum=True)
            timed = {}
            for name, fn in list(fns.items()):  # capture each alone first: one that cannot be captured is dropped
                try:
                    round_robin_seconds({name: fn}, 1, a.chain)
                    timed[name] = fn
                except Exception as e:  # noqa: BLE001
                    notes[name] = {"error": f"capture: {type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            t = round_robin_seconds(timed, a.rounds, a.chain)
            row = {"split": split, "gemm": gemm, "rows": R, "quack": notes,
                   **{f"{m} us": round(1e6 * s, 1) for m, s in t.items()},
                   **{f"{m} TFLOP/s": round(2 * R * k * n / s / 1e12, 1) for m, s in t.items()}}
            print(row, flush=True)
            rows.append(row)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "quack": quack.__version__,
                 "torch": torch.__version__, "chain": a.chain, "rounds": a.rounds, "tokens": TOKENS, "top_k": TOP_K,
                 "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
