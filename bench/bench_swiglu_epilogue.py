"""The MoE's SwiGLU in GEMM 1's epilogue against the separate SwiGLU pass, at the released shapes (issue 17).

One 1024x1024 CFG step routes T = 8194 tokens (2 rows x (1 + 4096)) to 8 of
64 experts: 65,552 rows, hidden 4096, expert width 3072. Two ways, in the same
run, both on our CUTLASS grouped kernel with fast accumulation (``--exact``: the exact-accumulation build,
what recipes without ``kernels.fp8_fast_accum`` run):

    separate   GEMM 1 -> h [R, 6144] bf16, then the Triton SwiGLU + e4m3 row quantization (one pass)
    epilogue   GEMM 1 with the SwiGLU epilogue (w13 rows in pairs) -> a [R, 3072] bf16, then the row
               quantization of a

Each is captured into a CUDA graph of ``--chain`` calls and replayed, so the
kernels run back to back at the clocks of sustained running under the power
cap (the step's condition); they take turns over ``--rounds`` rounds
(``bench_common.round_robin``) and the medians are reported, also for the whole routed-expert layer (sort,
gather, both GEMMs, combine). Errors are against the fp64 layer.

    python bench/bench_swiglu_epilogue.py --json out.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import chained_seconds, emit, git_commit  # noqa: E402

from omni.platform_manager import select  # noqa: E402
from omni.platforms.cuda import moe as cuda_moe  # noqa: E402
from omni.specs import MoESpec  # noqa: E402

T, D, I, E, TOPK = 8194, 4096, 3072, 64, 8


def per_call_ms(fns: dict, chain: int, rounds: int) -> dict:
    """ms per call of each function, captured ``chain`` calls to a graph and replayed round robin."""
    t = chained_seconds(fns, chain, rounds, burn=3 * len(fns), iters=3)
    return {name: round(sec * 1e3, 4) for name, sec in t.items()}


def operands(g):
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x = r(T, D).bfloat16()
    weights, ids = r(T, E).softmax(-1).topk(TOPK, -1)
    w13 = (r(E, 2 * I, D) / D ** 0.5).bfloat16()
    w2 = (r(E, D, I) / I ** 0.5).bfloat16()
    return x, weights, ids, w13, w2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--chain", type=int, default=16, help="calls per captured graph")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--exact", action="store_true", help="exact accumulation (the cooperative builds)")
    p.add_argument("--tiles", default="", help="other tile shapes MxN[cAxB] of the epilogue build to compare, e.g. "
                                               "128x192 or 128x192c2x1 (cluster AxB; default the platform's; "
                                               "the same schedule; built here)")
    a = p.parse_args()
    commit = git_commit()
    platform = select("cuda")
    platform.device_services(0)
    spec = MoESpec(num_experts=E, topk=TOPK, hidden=D, inner=I, dtype=torch.bfloat16, quant="fp8_row",
                   fast_accum=not a.exact, grouped_fp8="cutlass")
    fused = platform.moe(spec)
    if fused.paired is None:
        raise SystemExit(f"the SwiGLU epilogue did not build here: {fused.name}")
    separate = cuda_moe.CudaMoE(spec, fused.kernels, fused.gemm2.kernel)  # our plain kernel, no epilogue
    g = torch.Generator(device="cuda").manual_seed(0)
    x, weights, ids, w13, w2 = operands(g)
    pf, ps = fused.prepare_weights(w13, w2), separate.prepare_weights(w13, w2)
    token, _, offs = fused.kernels.route_rows(ids, E)
    xq, xs = fused.kernels.quant_gather(x, token)
    k = fused.kernels
    parts = {
        "separate": lambda: k.swiglu(separate.gemm13.scaled(xq, xs, ps.w13, offs), quantize=True),
        "epilogue": lambda: k.quant_rows(fused.gemm13.scaled(xq, xs, pf.w13, offs)),
        "gemm1_alone": lambda: separate.gemm13.scaled(xq, xs, ps.w13, offs),
        "gemm1_epilogue_alone": lambda: fused.gemm13.scaled(xq, xs, pf.w13, offs),
    }
    layers = {"separate": lambda: separate(x, weights, ids, ps), "epilogue": lambda: fused(x, weights, ids, pf)}
    others = {f"epilogue_{t}": other_tile(spec, fused, t) for t in a.tiles.split(",") if t}
    for name, moe in others.items():
        parts[name] = lambda moe=moe: k.quant_rows(moe.gemm13.scaled(xq, xs, pf.w13, offs))  # same paired weights
        layers[name] = lambda moe=moe: moe(x, weights, ids, pf)
    part_ms = per_call_ms(parts, a.chain, a.rounds)
    layer_ms = per_call_ms(layers, a.chain, a.rounds)
    ys, yf = separate(x, weights, ids, ps).double(), fused(x, weights, ids, pf).double()
    ref = reference(x, weights, ids, w13, w2)
    rel = lambda y: round(float((y - ref).norm() / ref.norm()), 5)  # noqa: E731
    out = dict(bench="swiglu_epilogue", commit=commit, gpu=torch.cuda.get_device_name(0), chain=a.chain,
               rounds=a.rounds, moe=fused.name, part_ms=part_ms, layer_ms=layer_ms,
               part_ratio=round(part_ms["epilogue"] / part_ms["separate"], 4),
               layer_ratio=round(layer_ms["epilogue"] / layer_ms["separate"], 4),
               rel_err_vs_fp64=dict(separate=rel(ys), epilogue=rel(yf),
                                    **{n: rel(m(x, weights, ids, pf).double()) for n, m in others.items()}),
               other_tiles_equal_epilogue={n: bool(torch.equal(m(x, weights, ids, pf), fused(x, weights, ids, pf)))
                                           for n, m in others.items()},
               rel_diff=round(float((yf - ys).norm() / ys.norm()), 5))
    return emit(out, a.json)


def other_tile(spec, fused, tile: str):
    """The platform's MoE with its epilogue build at another tile ``MxN`` and optionally cluster ``cAxB`` (K and
    the schedule kept)."""
    import dataclasses

    from omni.platforms.cuda import cutlass_grouped as cg

    shape, _, cluster = tile.partition("c")
    m, n = (int(v) for v in shape.split("x"))
    base = cg.SWIGLU_CONFIGS[spec.fast_accum]
    cfg = dataclasses.replace(base, tile=(m, n, base.tile[2]),
                              cluster=tuple(int(v) for v in cluster.split("x")) if cluster else base.cluster)
    kernel = cg.CutlassGroupedFp8(cg.build(cfg, cg.find_nvcc(), cg.find_cutlass_include()), cfg.name)
    return cuda_moe.CudaMoE(spec, fused.kernels, fused.gemm2.kernel, paired=kernel)


def reference(x, weights, ids, w13, w2):
    """The routed layer in fp64 from the bf16 weights, one expert at a time."""
    out = torch.zeros(T, D, dtype=torch.float64, device="cuda")
    for e in range(E):
        t, j = (ids == e).nonzero(as_tuple=True)
        x1, x2 = (x[t].double() @ w13[e].double().T).chunk(2, dim=-1)
        y = (x1 * torch.nn.functional.silu(x2)) @ w2[e].double().T
        out.index_add_(0, t, weights[t, j, None].double() * y)
    return out


if __name__ == "__main__":
    sys.exit(main())
