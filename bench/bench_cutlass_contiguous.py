"""Does a grouped fp8 GEMM on CUTLASS's PLAIN kernel reach the plain rate? (a prototype's benchmark)

Our grouped ptr-array kernel (platforms/cuda/csrc/grouped_fp8.cu) runs about
15% below CUTLASS's plain kernel with the same tile, cluster, stages and
epilogue (bench/bench_cutlass_dense.py) even with every row in one group: the
ptr-array machinery costs it. bench/csrc/contiguous_fp8_probe.cu builds the
grouped GEMM on the plain kernel instead, with a DeepGEMM-style contiguous
layout: the routed rows sorted by expert, each expert's block padded to a
multiple of 128 rows (256 for the 2x1 cluster, whose two CTAs share B and so
must share the expert), so every 128-row M tile has one expert
(``tile_expert``); the GEMM is batched over the experts (L = E) with A and D
shared by every batch (stride 0) and a tile scheduler that enumerates only the
(M, N) tiles, takes each tile's batch from ``tile_expert`` and skips the tiles
past the last expert. The capacity M_cap = roundup(R + E * (align - 1),
align) depends only on the token count, so a launch is capturable. The tile
order: CUTLASS's heuristic (along N here) and, by default besides it, the
expert-major order (``--sched E1``: each expert's tiles together, M fastest,
as the ptr-array kernel walks a group; it reads ``expert_tiles``, each
expert's first M tile, too).

At the released MoE shapes (64 experts, 8194 tokens, top 8: gate_up K 4096 ->
N 6144, down K 3072 -> N 4096) and two row splits (even: 1024 rows an expert;
routed: a top-8 routing of random logits, as bench/bench_cutlass_grouped.py),
the padded layout is built on the GPU from the rows the grouped kernel gets,
and timed side by side: every contiguous configuration, every configuration of
``--grouped-lib`` on the unpadded rows, and torch._scaled_mm (fast
accumulation) over all R rows against expert 0's weight (the dense rate). Each
is captured ``--chain`` times into a CUDA graph and the replays are timed
round robin over ``--rounds`` rounds (as bench/bench_cutlass_grouped.py).
TFLOP/s count the useful work only, 2 R N K. Checked: the contiguous
output's valid rows, mapped back to the unpadded order, against the grouped
kernel's (relative L2; the same products and scales, so ~0; torch's grouped
kernel when no ``--grouped-lib`` is given), no valid row NaN (the padding rows
of A and of the row scale are NaN, so a padding row leaking into a valid one
shows), and the scheduler itself: a check kernel walks the GEMM's scheduler
with the GEMM's params and launch grid as the ping-pong kernel's three roles
do, and every valid tile must be visited once by the producer and once by one
consumer, nothing else, with the cluster peers in step and each CTA's walk
equal to this file's Python model of the enumeration (``model_walks``).
Reported too: M_cap, the tiles computed and the padded-row waste.

The object is compiled with nvcc (about a minute, no GPU needed) into
``$OMNI_KERNEL_CACHE`` (default: omni-kernels under the system temp folder),
keyed by the source, the nvcc version and the CUTLASS headers, and reused.
``--build-only`` builds (or finds) it and checks the Python model of the
scheduler on the CPU with the object's launch grids.

    python bench/bench_cutlass_contiguous.py --build-only
    python bench/bench_cutlass_contiguous.py --grouped-lib grouped.so --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contiguous_walks import check_model, model_walks, walk_hash  # noqa: E402
from cutlass_probe import probe_configs, probe_library  # noqa: E402
from bench_common import emit, git_commit  # noqa: E402


SOURCE = Path(__file__).resolve().parent / "csrc" / "contiguous_fp8_probe.cu"
E, TOKENS, TOP_K = 64, 8194, 8
SHAPES = {"gate_up": (4096, 6144), "down": (3072, 4096)}  # name: (K, N)
TILE_M = TILE_N = 128
RASTER = {"H": 0, "M": 1, "N": 2, "E": 3}  # --sched letters: CUTLASS's heuristic, along M, along N, expert-major


def contiguous_configs(library: Path) -> list[str]:
    return probe_configs(library, "omni_cg")


class ContiguousFp8:
    """One exported configuration: for the rows of expert e in the contiguous layout,
    ``D[m, n] = bf16((A[m] @ B[e, n]) * sa[m] * sb[e, n])``, e4m3 in (bench/csrc/contiguous_fp8_probe.cu)."""

    def __init__(self, lib: ctypes.CDLL, config: str):
        self.config = config
        f = self._fn = {}
        i, p, st = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        for name, res, args in (("run_sched", i, [p] * 7 + [i] * 7 + [p, p]),
                                ("scratch", st, [i] * 5),
                                ("stages", i, []), ("align", i, []),
                                ("grid", i, [i] * 7 + [p]),
                                ("visits", i, [p, p] + [i] * 7 + [p, i, i, p, p])):
            fn = getattr(lib, f"omni_cg_{config}_{name}")
            fn.restype, fn.argtypes = res, args
            f[name] = fn
        self.stages, self.align = f["stages"](), f["align"]()

    def grid(self, m_cap: int, n: int, k: int, e: int, sms: int, raster: int = 0, swizzle: int = 1) -> dict:
        """The launch grid and the scheduler's tile grid for a problem (host only: no GPU needed)."""
        out = (ctypes.c_int64 * 12)()
        self._fn["grid"](m_cap, n, k, e, sms, raster, swizzle, out)
        keys = ("gx", "gy", "gz", "along_n", "log_swizzle", "blocks_m", "blocks_n", "blocks", "tiles_m", "cm", "cn",
                "cluster_cols")
        return {**dict(zip(keys, (int(v) for v in out))), "expert_major": raster == 3}

    def call(self, a, sa, b, sb, tile_expert, expert_tiles, out, raster: int = 0, swizzle: int = 1):
        """A no-argument call writing ``out`` [M_cap, N] in place (scratch allocated once); ``expert_tiles`` [E + 1]
        is read by the expert-major order (raster 3) only."""
        (m_cap, k), (e, n, _) = a.shape, b.shape
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        scratch = torch.empty(max(self._fn["scratch"](m_cap, n, k, e, sms), 256), dtype=torch.uint8, device="cuda")

        def fn():
            status = self._fn["run_sched"](a.data_ptr(), b.data_ptr(), out.data_ptr(), sa.data_ptr(), sb.data_ptr(),
                                           tile_expert.data_ptr(), expert_tiles.data_ptr(), m_cap, n, k, e, sms,
                                           raster, swizzle,
                                           scratch.data_ptr(), torch.cuda.current_stream().cuda_stream)
            if status:
                raise RuntimeError(f"{self.config}: CUTLASS refused the call (status {status}: 1 cannot implement, "
                                   f"2 initialize, 3 run, 4 launch error) for M_cap={m_cap} N={n} K={k} E={e}")
            return out

        return fn

    def visits(self, tile_expert, expert_tiles, m_cap: int, n: int, k: int, e: int, raster: int = 0,
               swizzle: int = 1):
        """Run the check kernel: (counts [3, tiles_m + 2, tiles_n + 2], per CTA [ctas, 8], the grid)."""
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        g = self.grid(m_cap, n, k, e, sms, raster, swizzle)
        cm, cn = -(-m_cap // TILE_M) + 2, -(-n // TILE_N) + 2
        counts = torch.zeros(3, cm, cn, dtype=torch.int32, device="cuda")
        per_cta = torch.zeros(g["gx"] * g["gy"] * g["gz"], 8, dtype=torch.int32, device="cuda")
        status = self._fn["visits"](tile_expert.data_ptr(), expert_tiles.data_ptr(), m_cap, n, k, e, sms, raster,
                                    swizzle, counts.data_ptr(), cm, cn, per_cta.data_ptr(),
                                    torch.cuda.current_stream().cuda_stream)
        if status:
            raise RuntimeError(f"{self.config}: the check kernel did not launch (status {status})")
        torch.cuda.synchronize()
        return counts.cpu(), per_cta.cpu(), g


def check_visits(kernel: ContiguousFp8, layout: dict, n: int, k: int, raster: int, swizzle: int) -> dict:
    """The check kernel's visits against the tiles that have an expert and against the Python model, CTA by CTA."""
    tile_expert = layout["tile_expert"]
    counts, per_cta, g = kernel.visits(tile_expert, layout["expert_tiles"], layout["m_cap"], n, k, E, raster,
                                       swizzle)
    te = tile_expert.cpu().tolist()
    nt = -(-n // TILE_N)
    want = torch.zeros_like(counts[0])
    want[:len(te), :nt] = torch.tensor([e >= 0 for e in te], dtype=torch.int32)[:, None]
    out = {"producer visits each valid tile once": bool(torch.equal(counts[0], want)),
           "consumers visit each valid tile once": bool(torch.equal(counts[1] + counts[2], want)),
           "bad visits (wrong expert / outside)": int(per_cta[:, 6].sum())}
    p, c0, c1 = per_cta[:, 0], per_cta[:, 1], per_cta[:, 2]
    out["consumers split the producer's tiles"] = bool(torch.equal(p, c0 + c1) and ((c0 - c1) >= 0).all()
                                                       and ((c0 - c1) <= 1).all())
    walks = model_walks(g, te, layout["expert_tiles"].tolist())
    model = []
    for by in range(g["gy"]):
        for bx in range(g["gx"]):  # per_cta's order: blockIdx.x + blockIdx.y * gridDim.x
            w = walks[bx, by]
            model.append([len(w), len(w[0::2]), len(w[1::2]), walk_hash(w, g["cm"]), walk_hash(w[0::2], g["cm"]),
                          walk_hash(w[1::2], g["cm"])])
    out["every CTA's walk equals the model"] = bool(torch.equal(per_cta[:, :6], torch.tensor(model,
                                                                                             dtype=torch.int32)))
    out["ok"] = all(v for key, v in out.items() if key != "bad visits (wrong expert / outside)") and \
        out["bad visits (wrong expert / outside)"] == 0
    return out


# ---- the layout ----

def contiguous_layout(counts, align: int, rows: int) -> dict:
    """The padded layout for ``counts`` [E] rows an expert (device): M_cap, each routed row's padded row ``dest``
    [R], ``tile_expert`` [M_cap / 128] int32 and ``expert_tiles`` [E + 1] int32 (each expert's first M tile)."""
    dev, e = counts.device, counts.numel()
    m_cap = -(-(rows + e * (align - 1)) // align) * align
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    base, starts = ends - padded, counts.cumsum(0) - counts
    expert = torch.repeat_interleave(torch.arange(e, device=dev), counts, output_size=rows)
    dest = base[expert] + torch.arange(rows, device=dev) - starts[expert]
    te = torch.searchsorted(ends, torch.arange(m_cap // TILE_M, device=dev) * TILE_M, right=True)
    tile_expert = torch.where(te < e, te, -1).to(torch.int32)
    expert_tiles = torch.cat([ends.new_zeros(1), ends]).div(TILE_M, rounding_mode="floor").to(torch.int32)
    valid = int((tile_expert >= 0).sum())
    return {"m_cap": m_cap, "dest": dest, "tile_expert": tile_expert, "expert_tiles": expert_tiles,
            "align": align, "valid_tiles": valid,
            "waste": 1 - rows / (valid * TILE_M)}


def padded_operands(layout: dict, xq, xs):
    """A [M_cap, K] and sa [M_cap] with the routed rows at ``dest``; the padding NaN (e4m3 0x7F, fp32 NaN): its
    outputs are never read, and a padding row leaking into a valid one shows as NaN."""
    a = torch.full((layout["m_cap"], xq.shape[1]), 0x7F, dtype=torch.uint8, device="cuda")
    a[layout["dest"]] = xq.view(torch.uint8)
    sa = torch.full((layout["m_cap"],), float("nan"), device="cuda")
    sa[layout["dest"]] = xs
    return a.view(torch.float8_e4m3fn), sa


def cpu_model_check(kernels: list[ContiguousFp8], sms: int) -> list[dict]:
    """The Python model's assertions for each configuration, shape and a few splits (even, uneven with empty and
    odd-tiled experts, all rows to one expert), with the object's own launch grids: no GPU needed."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, E, generator=g)
    uneven = torch.bincount(logits.topk(TOP_K, -1).indices.flatten(), minlength=E)
    sparse = uneven.clone()
    sparse[::5] = 0  # empty experts
    sparse[1::7] = 1  # one-row experts
    one = torch.zeros(E, dtype=torch.int64)
    one[3] = TOKENS * TOP_K
    results = []
    for kernel in kernels:
        for name, (k, n) in SHAPES.items():
            for split, counts in (("even", torch.full((E,), TOKENS * TOP_K // E)), ("routed", uneven),
                                  ("sparse", sparse), ("one", one)):
                rows = int(counts.sum())
                lay = contiguous_layout(counts, kernel.align, rows)
                for raster, swizzle in ((0, 1), (1, 1), (1, 2), (2, 4), (3, 1)):
                    grid = kernel.grid(lay["m_cap"], n, k, E, sms, raster, swizzle)
                    walks = check_model(grid, lay["tile_expert"].tolist(), lay["expert_tiles"].tolist(),
                                        -(-n // TILE_N))
                    results.append({"config": kernel.config, "gemm": name, "split": split, "raster": raster,
                                    "swizzle": swizzle, "m_cap": lay["m_cap"], "grid": (grid["gx"], grid["gy"]),
                                    "tiles": sum(len(w) for w in walks.values())})
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", type=Path, help="the probe's built shared object (default: build it, or find it in "
                   "the cache)")
    p.add_argument("--grouped-lib", type=Path, action="append", default=[],
                   help="a grouped_fp8 shared object: time its every configuration on the unpadded rows and check "
                   "the contiguous outputs against its first (repeatable; default: torch's grouped kernel is the "
                   "reference and no grouped object is timed)")
    p.add_argument("--build-only", action="store_true", help="only build (or find) the probe object, print its "
                   "path and exports and check the Python model of the scheduler (no GPU needed)")
    p.add_argument("--json", type=Path)
    p.add_argument("--one-weight", action="store_true", help="also time each configuration (heuristic order) with "
                   "every tile against expert 0's weight: the same kernel, walk and rows without the 64 weights' "
                   "traffic (its output is not checked: it is another product)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chain", type=int, default=8, help="capture each kernel N times back to back into a CUDA "
                   "graph and time its replays (the sustained rate, as in a captured step)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: gate_up, down")
    p.add_argument("--splits", default="even,routed", help="comma-separated: even (1024 rows an expert), routed "
                   "(a top-8 routing of random logits), one (every row to expert 0)")
    p.add_argument("--sched", default="H1,E1", help="tile orders of the contiguous kernel to time, "
                   "comma-separated: a raster letter (H: CUTLASS's heuristic, along N here; M; N; E: expert-major, "
                   "each expert's tiles M fastest, as the ptr-array kernel walks a group) and a swizzle (1-8, "
                   "ignored by E), e.g. H1,N8,E1")
    p.add_argument("--sms", type=int, default=132, help="SM count for --build-only's model check (the H200's)")
    a = p.parse_args()
    sched = [(RASTER[s[0]], int(s[1:])) for s in a.sched.split(",")]

    lib_path = probe_library(SOURCE, a.lib)
    if a.build_only:
        print(lib_path)
        lib = ctypes.CDLL(str(lib_path))  # the exports below are host functions: no GPU needed
        kernels = [ContiguousFp8(lib, c) for c in contiguous_configs(lib_path)]
        print({k.config: {"stages": k.stages, "align": k.align} for k in kernels}, file=sys.stderr)
        checked = cpu_model_check(kernels, a.sms)
        print(f"model of the scheduler: {len(checked)} cases pass (every valid tile walked once, nothing else, "
              f"cluster peers in step)", file=sys.stderr)
        for r in checked:
            if r["raster"] == 0 and r["split"] in ("even", "routed"):
                print(r, file=sys.stderr)
        return 0

    from bench_common import round_robin_seconds  # noqa: E402 (a GPU run only)
    from bench_cutlass_grouped import call, fp8, splits  # noqa: E402

    from omni.platforms.cuda.cutlass_grouped import CutlassGroupedFp8, exported_configs  # noqa: E402

    lib = ctypes.CDLL(str(lib_path))
    kernels = [ContiguousFp8(lib, c) for c in contiguous_configs(lib_path)]
    grouped = [CutlassGroupedFp8(gl, name) for gl in a.grouped_lib for name in exported_configs(gl)]
    info = {k.config: {"stages": k.stages, "align": k.align} for k in kernels}
    print({"library": str(lib_path), "configs": info}, flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)  # as bench/bench_cutlass_grouped.py: the same routed split
    rows_out = []
    for split, counts in splits(g).items():
        if split not in a.splits.split(","):
            continue
        offs = counts.cumsum(0).to(torch.int32)
        R = int(offs[-1])
        layouts = {align: contiguous_layout(counts, align, R) for align in sorted({k.align for k in kernels})}
        for name, (k, n) in SHAPES.items():
            if name not in a.shapes.split(","):
                continue
            xq, xs = fp8(torch.randn(R, k, device="cuda", generator=g).bfloat16())
            wq, ws = fp8(torch.randn(E, n, k, device="cuda", generator=g).bfloat16())
            xs, ws = xs.view(-1).contiguous(), ws.view(E, n).contiguous()
            flops = 2 * R * n * k
            fns = {"dense _scaled_mm fast": lambda: torch._scaled_mm(
                xq, wq[0].t(), scale_a=xs.view(-1, 1), scale_b=ws[0].view(1, -1), out_dtype=torch.bfloat16,
                use_fast_accum=True)}
            for kernel in grouped:
                fns[f"grouped {kernel.config}"] = call(kernel, xq, xs, wq, ws, offs, 0, 1)
            if grouped:
                ref_name = f"grouped {grouped[0].config}"
                ref = fns[ref_name]().float()
            else:
                ref_name = "torch _scaled_grouped_mm fast"
                ref = torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs, ws, offs=offs, out_dtype=torch.bfloat16,
                                               use_fast_accum=True).float()
            err, nan_rows, identical, layout_info, checks = {}, {}, {}, {}, {}
            padded = {align: padded_operands(lay, xq, xs) for align, lay in layouts.items()}
            for kernel in kernels:
                lay = layouts[kernel.align]
                a_pad, sa_pad = padded[kernel.align]
                out = torch.full((lay["m_cap"], n), float("nan"), dtype=torch.bfloat16, device="cuda")
                for raster, swizzle in sched:
                    label = f"contiguous {kernel.config}" + (
                        "" if (raster, swizzle) == (0, 1) else " expert-major" if raster == 3 else
                        f" r{'HMN'[raster]}s{swizzle}")
                    checks[label] = check_visits(kernel, lay, n, k, raster, swizzle)
                    if not checks[label]["ok"]:
                        print(f"{label}: the scheduler check FAILED, not run: {checks[label]}", flush=True)
                        continue
                    fns[label] = kernel.call(a_pad, sa_pad, wq, ws, lay["tile_expert"], lay["expert_tiles"], out,
                                             raster, swizzle)
                    out.fill_(float("nan"))
                    got = fns[label]()[lay["dest"]].float()
                    err[label] = float((got - ref).norm() / ref.norm())
                    nan_rows[label] = int(got.isnan().any(1).sum())
                    identical[label] = bool(torch.equal(got, ref))
                    if a.one_weight and raster == 0:  # the same walk and rows, every tile against expert 0's weight
                        one_te = torch.where(lay["tile_expert"] >= 0, 0, -1).to(torch.int32)
                        out_one = torch.empty_like(out)
                        fns[f"{label} one weight"] = kernel.call(a_pad, sa_pad, wq, ws, one_te, lay["expert_tiles"],
                                                                 out_one, raster, swizzle)
                grid = kernel.grid(lay["m_cap"], n, k, E, torch.cuda.get_device_properties(0).multi_processor_count)
                layout_info[kernel.config] = {
                    "align": lay["align"], "M_cap": lay["m_cap"], "tiles (M_cap / 128)": lay["m_cap"] // TILE_M,
                    "tiles with an expert": lay["valid_tiles"], "padded-row waste": round(lay["waste"], 4),
                    "grid": [grid["gx"], grid["gy"]], "raster": "along N" if grid["along_n"] else "along M"}
            torch.cuda.synchronize()
            t = round_robin_seconds(fns, a.rounds, a.chain)
            row = {"split": split, "gemm": name, "R": R, "N": n, "K": k, "max_rows": int(counts.max()),
                   # the ptr-array kernel computes whole 128-row tiles too: a group's last tile is partly empty
                   "grouped kernel's M tiles": int(((counts + TILE_M - 1) // TILE_M).sum()),
                   **{f"{label} TFLOP/s": round(flops / s / 1e12, 1) for label, s in t.items()},
                   "reference": ref_name, "rel err vs reference": err, "bit-identical to reference": identical,
                   "valid rows with NaN": nan_rows, "scheduler checks": checks, "layout": layout_info,
                   "timing": f"graph of {a.chain} calls, median of {a.rounds} rounds"}
            print(row, flush=True)
            rows_out.append(row)
            del fns, ref, padded
            torch.cuda.empty_cache()
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "library": str(lib_path),
                 "grouped libraries": [str(gl) for gl in a.grouped_lib], "configs": info, "rows": rows_out}, a.json)


if __name__ == "__main__":
    sys.exit(main())
