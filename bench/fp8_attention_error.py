"""How much error each low-precision attention scheme adds, simulated on the CPU (issue 17 item 3; no GPU).

FA3's fp8 forward (``attention.fp8``) fails the random-layer quality gate (BENCHMARKS.md, "FP8 attention"). This
asks which of its roundings costs the error, and whether finer scales or another scheme would pass. Each scheme
is the exact attention computed in fp32 on operands rounded as that scheme rounds them:
- ``fa3_fp8``: q, k, v in e4m3 with one scale per tensor (what ``attention.fp8`` passes FA3), and the
  probabilities P = exp(s - max) cast to e4m3 unscaled before the PV product, as FA3's fp8 kernel does;
- ``fa3_fp8_per_head``: the same with one scale per head (FA3 takes descales per sequence and KV head);
- ``qkv_fp8_exact_p``: q, k, v per tensor with P exact (the reference platform's ``fp8`` semantics);
- ``qk_fp8``: only q and k in e4m3 (v and P exact);
- ``qk_int8_smoothed``: q and k in int8 with a scale per 128-token block and head, k minus its mean over the
  tokens first (softmax ignores a shift shared by a query's scores), v and P exact (SageAttention's QK);
- ``qk_int8_smoothed_pv_fp8``: that, with P scaled by 448 into e4m3 and v in e4m3 per channel (its PV).
Inputs as the model feeds them: q and k after the QK-norm (RMS 1 per head), GQA 32/8 heads of 128, one sequence of
``--queries`` queries against a ``--prefix``-token prefix plus itself. Errors: relative L2 against fp32.

    python bench/fp8_attention_error.py --json out.json
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402

from omni import quant  # noqa: E402

N, K, H, BLOCK = 32, 8, 128, 128
E4M3 = torch.float8_e4m3fn


def through_e4m3(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return (x / scale).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(E4M3).float() * scale


def per_head(x_THD):
    return through_e4m3(x_THD, x_THD.abs().amax(dim=(0, 2), keepdim=True) / quant.FP8_MAX)


def int8_blocks(x_THD):
    """int8 with a scale per ``BLOCK`` tokens and head (rows past a multiple of BLOCK form a last, short block)."""
    out = torch.empty_like(x_THD)
    for t in range(0, x_THD.shape[0], BLOCK):
        b = x_THD[t:t + BLOCK]
        scale = b.abs().amax(dim=(0, 2), keepdim=True).clamp_min(1e-12) / 127
        out[t:t + BLOCK] = (b / scale).round().clamp(-127, 127) * scale
    return out


def attention(q_TNH, k_SKH, v_SKH, p_rounding=None) -> torch.Tensor:
    """Exact fp32 attention (GQA) with the probabilities rounded by ``p_rounding`` before the PV product."""
    rep = q_TNH.shape[1] // k_SKH.shape[1]
    k_NSH, v_NSH = (x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in (k_SKH, v_SKH))
    s_NTS = torch.matmul(q_TNH.transpose(0, 1), k_NSH.transpose(1, 2)) / math.sqrt(q_TNH.shape[-1])
    p_NTS = torch.exp(s_NTS - s_NTS.amax(-1, keepdim=True))
    denom_NT1 = p_NTS.sum(-1, keepdim=True)
    p_NTS = p_rounding(p_NTS) if p_rounding is not None else p_NTS
    return (torch.matmul(p_NTS, v_NSH) / denom_NT1).transpose(0, 1)


def schemes(q, k, v) -> dict:
    fq, fk, fv = (quant.fake_quantize_fp8(x) for x in (q, k, v))  # one scale per tensor
    qi, ki = int8_blocks(q), int8_blocks(k - k.mean(dim=0, keepdim=True))
    p_e4m3 = lambda p: p.to(E4M3).float()  # noqa: E731  FA3: P in [0, 1], no scale
    p_scaled = lambda p: through_e4m3(p, 1.0 / quant.FP8_MAX)  # noqa: E731  SageAttention2: P x 448
    v_channel = through_e4m3(v, v.abs().amax(dim=0, keepdim=True) / quant.FP8_MAX)
    return {"fa3_fp8": lambda: attention(fq, fk, fv, p_e4m3),
            "fa3_fp8_per_head": lambda: attention(per_head(q), per_head(k), per_head(v), p_e4m3),
            "qkv_fp8_exact_p": lambda: attention(fq, fk, fv),
            "qk_fp8": lambda: attention(fq, fk, v),
            "qk_int8_smoothed": lambda: attention(qi, ki, v),
            "qk_int8_smoothed_pv_fp8": lambda: attention(qi, ki, v_channel, p_scaled)}


def inputs(queries: int, prefix: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    norm = lambda x: torch.nn.functional.rms_norm(x, (H,)).bfloat16().float()  # noqa: E731  the model's QK-norm
    q = norm(torch.randn(queries, N, H, generator=g) * 3)
    k = norm(torch.randn(queries + prefix, K, H, generator=g) * 3)
    return q, k, torch.randn(queries + prefix, K, H, generator=g).bfloat16().float()


def errors(queries: int, prefix: int, seed: int = 0) -> dict[str, float]:
    q, k, v = inputs(queries, prefix, seed)
    want = attention(q, k, v)
    rel = lambda y: float((y - want).norm() / want.norm())  # noqa: E731
    return {"bf16_output_rounding": rel(want.bfloat16().float())} | {
        name: rel(fn()) for name, fn in schemes(q, k, v).items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=1024)
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    runs = [errors(a.queries, a.prefix, seed) for seed in range(a.seeds)]
    rows = {name: [r[name] for r in runs] for name in runs[0]}
    for name, errs in rows.items():
        print(f"{name:26s} " + " ".join(f"{e:.4f}" for e in errs), file=sys.stderr)
    return emit({"bench": "fp8_attention_error", "commit": git_commit(), "args": vars(a) | {"json": None},
                 "relative_l2_vs_fp32": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
