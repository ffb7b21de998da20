"""bench_fast's per-kernel breakdown: kernel time per layer by kernel and category (torch.profiler over an
eager pass or graph replays), and the step's image input and output outside the backbone."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import median_seconds  # noqa: E402
from fast_floor import step_flops  # noqa: E402
from fast_setup import Setup, sync  # noqa: E402

from omni.models.hunyuan_image3.sampler import cfg_combine, euler_step  # noqa: E402


def profile(s: Setup, out, label, graph: bool = False):
    """Kernel time per layer by kernel and category: one eager backbone pass, or (``graph``) two replays of the
    captured backbone right after its timed loop (the clocks of sustained running), with the replays' wall
    time beside the kernel sum: what is left between them is idle time between kernels, not clocks."""
    from torch.profiler import ProfilerActivity, profile as prof

    x = s.block_input(torch.full((1,), 900.0, device=s.device))
    passes = 2 if graph else 1

    @torch.inference_mode()
    def run():
        return s.graphs.run(s.graph_key, x, s.model.backbone, None) if graph else s.backbone(x)

    run()
    sync()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        wall_ms = median_seconds(lambda: [run() for _ in range(passes)], 1, warmup=0) * 1e3 / passes / s.a.layers
    rows = []
    for ev in p.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.key and not ev.key.startswith(("cudaLaunch", "cudaStream")):
            rows.append((ev.key, t / 1e3 / s.a.layers / passes, ev.count // s.a.layers // passes))
    rows = sorted({r[0]: r for r in rows}.values(), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)

    cats: dict[str, float] = {}
    for name, ms, _ in rows:
        cats[category(name)] = cats.get(category(name), 0.0) + ms
    fl = step_flops(s.cfg, s.rows * s.n_block, [])
    moved = fl["shared_expert"] if s.a.fuse_shared else 0  # the shared expert runs as the grouped GEMMs' last group
    rates = gemm_rates(rows, fl["routed"] + moved, fl["dense"] - moved)
    out[f"kernels_{label}"] = {"mode": "graph replay" if graph else "eager", "per_layer_ms_total": total,
                               "per_layer_wall_ms": wall_ms, "by_category_ms": cats, "gemm_rates": rates,
                               "top": [{"kernel": n[:120], "ms_per_layer": m, "calls_per_layer": c}
                                       for n, m, c in rows[:40]]}
    print(f"[kernels {label}] per layer {total:.2f} ms of kernel time in {wall_ms:.2f} ms of wall time "
          f"({'graph replay' if graph else 'eager'}): " + ", ".join(f"{k} {v:.2f}" for k, v in cats.items()),
          flush=True)
    if rates:
        print(f"[kernels {label}] in the step: expert GEMMs {rates['grouped_tflops']:.0f} TFLOP/s, dense GEMMs "
              f"{rates['dense_tflops']:.0f} TFLOP/s (grouped / dense {rates['grouped_over_dense']:.2f}x)", flush=True)
    for n, m, c in rows[:12]:
        print(f"    {m:7.3f} ms  x{c:<3d} {n[:100]}", flush=True)


GROUPED_GEMMS = ("groupproblemshape", "grouped", "deep_gemm")  # the expert GEMMs' kernel names (CUTLASS, DeepGEMM)


def category(name: str) -> str:
    """A kernel's category in the breakdown, by its name."""
    n = name.lower()
    if "flash" in n or "fmha" in n or "attn" in n:
        return "attention"
    if any(w in n for w in ("gemm", "cutlass", "nvjet", "sm90", "xmma", "matmul", "_mm")):
        return "gemm"
    if "triton" in n or n.startswith("_"):
        return "triton"
    return "other (norm, rope, routing, copies, casts)"


def gemm_rates(rows, routed_flops: float, dense_flops: float) -> dict:
    """The expert GEMMs' and the dense GEMMs' rates inside the step, from the profile's ``(name, ms per layer,
    calls)`` rows: issue 17's item 2 (grouped at the dense rate) on the engine's own activations. On a 700 W H100
    random operands and the step's activations ranked two grouped kernels differently (BENCHMARKS.md,
    "Forty-fifth session"). Empty where either kind of GEMM is missing."""
    gemms = [(n.lower(), ms) for n, ms, _ in rows if category(n) == "gemm"]
    grouped = sum(ms for n, ms in gemms if any(w in n for w in GROUPED_GEMMS))
    dense = sum(ms for _, ms in gemms) - grouped
    if grouped <= 0 or dense <= 0:
        return {}
    g, d = routed_flops / grouped / 1e9, dense_flops / dense / 1e9  # FLOPs per ms -> TFLOP/s
    return {"grouped_ms": grouped, "dense_ms": dense, "grouped_tflops": g, "dense_tflops": d,
            "grouped_over_dense": g / d}


def profile_io(s: Setup, out, label):
    """The step outside the backbone (patch embed + timestep token; final layer, CFG combine, Euler):
    wall time against the sum of its kernels and their count, per part. Where the model keeps NHWC conv
    weights (the platform's channels_last capability) it is measured again with NCHW copies of them (the
    baseline), and the same weight tensors go back afterwards (captured graphs point at them)."""
    io_parts(s, out, label)
    if not s.model.channels_last:
        return
    convs = [c for head in (s.model.patch_embed, s.model.final_layer) for c in head.modules()
             if isinstance(c, torch.nn.Conv2d)]
    kept = [c.weight.data for c in convs]
    for c, w in zip(convs, kept):
        c.weight.data = w.contiguous()
    try:
        io_parts(s, out, f"{label}_nchw_weights")
    finally:
        for c, w in zip(convs, kept):
            c.weight.data = w


def io_parts(s: Setup, out, label):
    from torch.profiler import ProfilerActivity, profile as prof

    m, t = s.model, torch.full((1,), 900.0, device=s.device)
    h = torch.randn(s.rows * s.n_block, s.cfg.hidden_size, device=s.device, dtype=torch.bfloat16)

    @torch.inference_mode()
    def tail():
        v = m.velocity(h.view(s.rows, s.n_block, -1)[:, 1:], t.repeat(s.rows), s.th, s.tw)
        return euler_step(s.latents, cfg_combine(v[:1], v[1:], 5.0), 0.9, 0.88)

    res = out[f"image_io_{label}"] = {}
    for name, fn in (("block_input", lambda: s.block_input(t)), ("velocity_cfg_euler", tail)):
        wall = median_seconds(fn, 20)
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            fn()
            sync()
        evs = [(ev.key, getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0), ev.count)
               for ev in p.key_averages()]
        evs = [e for e in evs if e[1] > 0 and not e[0].startswith(("cudaLaunch", "cudaStream"))]
        kern = sum(e[1] for e in evs) / 1e3
        res[name] = {"wall_ms": wall * 1e3, "kernel_ms": kern, "launches": sum(e[2] for e in evs),
                     "top": [{"kernel": k[:100], "ms": v / 1e3, "calls": c} for k, v, c in
                             sorted(evs, key=lambda e: -e[1])[:10]]}
        print(f"[image io {label}] {name}: wall {wall*1e3:.2f} ms, kernels {kern:.2f} ms in "
              f"{res[name]['launches']} launches", flush=True)
        for k, v, c in sorted(evs, key=lambda e: -e[1])[:8]:
            print(f"    {v/1e3:7.3f} ms  x{c:<3d} {k[:100]}", flush=True)
