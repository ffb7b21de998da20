"""Launch shapes of the cuda platform's memory-bound row kernels at the released shapes, in one run.

Each Triton kernel of the glue (``glue_triton``) and the MoE SwiGLU (``moe_triton``) takes ``ROWS`` rows
(tokens) per program and runs with some warps; ``TILES`` / ``TritonKernels.swiglu_tile`` hold what the
platform launches. This sweeps (rows, warps) for every kernel through the platform's own launch code
(``TritonGlue`` and ``TritonKernels`` with their tile set per try; ``quant_tiles`` per width for the row
quantization), times CUDA-event medians, and compares
every output bit for bit with the platform's current tile's. Bits can differ: a row's sum reduces in an
order that depends on the launch shape (a rounding of the activation dtype at most; the conformance tests
hold every shape the platform launches to the oracle).

    python bench/bench_row_kernels.py --json out.json

One 1024x1024 CFG step: T = 8194 tokens, hidden 4096, 32 / 8 heads of 128, shared-expert width 3072,
65,552 routed rows (64 experts, top 8) into the MoE SwiGLU of width 3072.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from omni.specs import GlueSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_event_median, emit, git_commit  # noqa: E402

T, D, N, K, H, I, E, TOPK = 8194, 4096, 32, 8, 128, 3072, 64, 8
R = T * TOPK
SWEEP = {
    "norm": [(r, w) for r in (1, 2, 4) for w in (4, 8, 16)],
    "rope": [(r, w) for r in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8)],
    "route": [(r, w) for r in (4, 8, 16, 32, 64) for w in (1, 2, 4, 8)],
    "swiglu": [(r, w) for r in (1, 2, 4) for w in (4, 8, 16)],
}
SWEEP["moe_swiglu"] = SWEEP["swiglu"]
SWEEP["quant_routed"] = SWEEP["quant_hidden"] = [(r, w) for r in (1, 2, 4, 8) for w in (4, 8, 16)]
SWEEP["scatter"] = [(r, w) for r in (1, 2, 4) for w in (2, 4, 8, 16)]
SWEEP["combine"] = [(r, w) for r in (1, 2, 4) for w in (2, 4, 8, 16)]
MOE_TILES = {"moe_swiglu": "swiglu_tile", "scatter": "scatter_tile", "combine": "combine_tile"}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", type=Path)
    p.add_argument("--keys", default=",".join(SWEEP), help="tile keys to sweep (default: all of them)")
    return p.parse_args()


def outputs(result) -> list[torch.Tensor]:
    """Every tensor of a kernel's result (RowQuantized included), flat, for bit comparisons."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in outputs(r)]
    return [t for t in (getattr(result, f, None) for f in ("q_TI", "scale_T1", "x_TI")) if t is not None]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def cases(glue, moe):
    """(name, tile key, the call, bytes read + written once, where to set the tile)."""
    g = torch.Generator("cuda").manual_seed(0)
    x, d = (torch.randn(T, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    w = 1 + 0.1 * torch.randn(D, device="cuda", generator=g, dtype=torch.bfloat16)
    qkv = torch.randn(T, (N + 2 * K) * H, device="cuda", generator=g, dtype=torch.bfloat16)
    ang = torch.randn(T, H // 2, device="cuda", generator=g)
    cos, sin = (torch.cat([f(ang), f(ang)], -1).bfloat16() for f in (torch.cos, torch.sin))
    wq, wk = (1 + 0.1 * torch.randn(H, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    logits = torch.randn(T, E, device="cuda", generator=g)
    h_shared = torch.randn(T, 2 * I, device="cuda", generator=g, dtype=torch.bfloat16)
    h_routed = torch.randn(R, 2 * I, device="cuda", generator=g, dtype=torch.bfloat16)
    h_epilogue = torch.randn(R, I, device="cuda", generator=g, dtype=torch.bfloat16)
    xq, xs = moe.quant_rows(x)
    _, inverse_R, _ = moe.route_rows(torch.randint(0, E, (T, TOPK), device="cuda", generator=g), E)
    y_routed = torch.randn(R, D, device="cuda", generator=g, dtype=torch.bfloat16)
    w_Tk = torch.rand(T, TOPK, device="cuda", generator=g)
    b16 = 2
    return [
        ("rms_norm + fp8 rows", "norm", lambda: glue.rms_norm(x, w, True), T * D * (2 + 2 + 1)),
        ("add + rms_norm + fp8 rows", "norm", lambda: glue.add_rms_norm(x, d, w, True),
         T * D * (2 * b16 + 2 * b16 + 1)),
        ("rope + qk-norm + v", "rope", lambda: glue.rope_qk_norm(qkv, cos, sin, wq, wk, (N, K)),
         2 * T * (N + 2 * K) * H * b16 + 2 * T * H * b16),
        ("router softmax + top-8", "route", lambda: glue.route(logits), T * E * 4 + T * TOPK * 12),
        ("shared swiglu + fp8 rows", "swiglu", lambda: glue.swiglu(h_shared, True), T * I * (2 * b16 + 1)),
        ("moe swiglu + fp8 rows (65,552 rows)", "moe_swiglu", lambda: moe.swiglu(h_routed, quantize=True),
         R * I * (2 * b16 + 1)),
        ("fp8 rows of the epilogue's h (65,552 x 3072)", "quant_routed", lambda: moe.quant_rows(h_epilogue),
         R * I * (b16 + 1)),
        ("fp8 rows of o_proj's input (8194 x 4096)", "quant_hidden", lambda: moe.quant_rows(x), T * D * (b16 + 1)),
        ("scatter of e4m3 rows (8194 x 4096 -> 65,552)", "scatter", lambda: moe.scatter_rows(xq, xs, inverse_R),
         (T + R) * D),
        ("combine of 8 rows + 2 addends (8194 x 4096)", "combine",
         lambda: moe.combine(y_routed, inverse_R, w_Tk, torch.bfloat16, (x, d)), (R + 3 * T) * D * b16),
    ]


def set_tile(glue, moe, key: str, tile) -> None:
    """``moe_swiglu``: the routed rows' SwiGLU; ``swiglu``: the shared expert's (the same kernel, its own tile);
    ``scatter`` and ``combine``: the MoE's (``MOE_TILES``)."""
    if key in MOE_TILES:
        setattr(moe, MOE_TILES[key], tile)
    elif key.startswith("quant"):
        moe.quant_tiles[I if key == "quant_routed" else D] = tile
    else:
        glue.tiles[key] = tile


def current_tile(glue, moe, key: str):
    quant = {"quant_routed": moe.quant_tiles.get(I, moe.quant_tile),
             "quant_hidden": moe.quant_tiles.get(D, moe.quant_tile)}
    return {**{k: getattr(moe, attr) for k, attr in MOE_TILES.items()}, **quant}.get(key) or glue.tiles[key]


def main() -> int:
    a = parse()
    from omni.platforms.cuda.glue import TritonGlue
    from omni.platforms.cuda.glue_triton import Tile
    from omni.platforms.cuda.moe_triton import TritonKernels

    moe = TritonKernels()
    glue = TritonGlue(GlueSpec(hidden=D, head_dim=H, eps=1e-5, dtype=torch.bfloat16, topk=TOPK), moe)
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_bw = 2 * copy_src.numel() / cuda_event_median(lambda: copy_dst.copy_(copy_src), a.iters)
    copy_src = copy_dst = None  # frees 2 GiB before the cases (rebinding: the lambda above names them)
    out = {"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bandwidth_TBps": copy_bw / 1e12, "rows": []}
    for name, key, fn, nbytes in cases(glue, moe):
        if key not in a.keys.split(","):
            continue
        base_tile = current_tile(glue, moe, key)
        want = [t.clone() for t in outputs(fn())]
        row = {"step": name, "tile_key": key, "current": [base_tile.rows, base_tile.warps],
               "floor_us": nbytes / copy_bw * 1e6, "tries": []}
        for rows, warps in SWEEP[key]:
            set_tile(glue, moe, key, Tile(rows, warps))
            try:
                got = outputs(fn())
                us = cuda_event_median(fn, a.iters) * 1e6
                row["tries"].append({"rows": rows, "warps": warps, "us": us, "TBps": nbytes / us / 1e6,
                                     "bit_identical": same_bits(got, want)})
            except Exception as e:  # a launch shape Triton cannot compile is reported, the sweep goes on
                row["tries"].append({"rows": rows, "warps": warps, "error": f"{type(e).__name__}: {e}"[:200]})
        set_tile(glue, moe, key, base_tile)
        timed = [t for t in row["tries"] if "us" in t]
        best = min(timed, key=lambda t: t["us"])
        cur = next(t for t in timed if (t["rows"], t["warps"]) == (base_tile.rows, base_tile.warps))
        row.update(best=best, current_us=cur["us"], speedup=cur["us"] / best["us"])
        print(f"{name:40s} current {cur['us']:7.1f} us  best {best['us']:7.1f} us at rows={best['rows']} "
              f"warps={best['warps']} ({best['TBps']:.2f} TB/s, floor {row['floor_us']:.1f} us, "
              f"identical={best['bit_identical']})", flush=True)
        out["rows"].append(row)
    return emit(out, a.json)


if __name__ == "__main__":
    sys.exit(main())
