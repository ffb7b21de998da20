"""Our engine against the naive path and the kernel floor, at full size, on one GPU.

Workload: one 1024x1024 image, 50 steps, CFG 5 (two rows), a ~300-token text
prefix per row, the released widths (hidden 4096, 32/8 heads of 128, 64
experts top-8 of width 3072 + a shared expert), RANDOM weights, ``--layers``
decoder layers; per-layer times are extrapolated to the released 32 layers
(the output says so). Per step: 2 x (``<timestep>`` + 4096 image tokens) =
8194 query tokens, each row attending to its prefix + its block.

  (a) engine   our path: prefix KV prefilled once, packed varlen step, fused MoE
               (``omni_moe_impl``), fp8 (``--quant``) and bf16, eager and graph-captured
               (``omni.step_graphs``); per step, per layer, per image (prefill + 50 steps + VAE decode)
  (b) naive    same bf16 weights: the whole sequence (prefix + block) recomputed every
               step with one dense-masked SDPA, a per-expert Python loop, no prefix cache
  (c) floor    the step's GEMMs (exact shapes, pre-quantized inputs, balanced experts) and
               its attention kernel, timed alone: time no implementation can beat by much

Parts: the model under test and the timers (``fast_setup.py``), (b) in ``fast_naive.py``, (c) in
``fast_floor.py``, the per-kernel breakdown in ``fast_profile.py``; this file runs them in order.

Also: a per-kernel breakdown of one engine step (torch.profiler), MFU against
the datasheet peaks (bf16 989 / fp8 1979 dense TFLOP/s), peak memory, and
FP8-vs-BF16 relative error of the step's prediction on these random layers.

    python bench/bench_fast.py --layers 4 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_floor import floor  # noqa: E402
from fast_naive import naive  # noqa: E402
from fast_profile import profile, profile_io  # noqa: E402
from bench_common import git_commit, median_seconds  # noqa: E402
from fast_setup import PEAK, RELEASED_LAYERS, Setup, sync  # noqa: E402
from random_fullsize import random_init_  # noqa: E402

from omni.platform_manager import select  # noqa: E402
from omni.step_graphs import StepGraphs  # noqa: E402

RANDOM_LAYERS_GATE = 0.12  # docs/quality.md: fp8_row vs bf16 backbone output, random full-size layers


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--steps", type=int, default=50, help="steps per image (for the per-image figure)")
    p.add_argument("--timed", type=int, default=10, help="timed steps per variant")
    p.add_argument("--quant", default="fp8_row")
    p.add_argument("--no-naive", action="store_true")
    p.add_argument("--attn-fp8", action="store_true", help="the fp8 engine also runs attention in e4m3 (attention.fp8)")
    p.add_argument("--fast-accum", action="store_true",
                   help="fp8 GEMMs accumulate without fp32 promotion (kernels.fp8_fast_accum), engine and floor")
    p.add_argument("--grouped-fp8", choices=["auto", "torch", "cutlass", "deepgemm"], default="auto",
                   help="kernel of the fp8 expert GEMMs (kernels.grouped_fp8), engine and floor")
    p.add_argument("--shared-stream", action="store_true",
                   help="the engine runs each layer's shared expert on a side stream (kernels.shared_expert_stream)")
    p.add_argument("--fuse-shared", action="store_true", help="each layer's shared expert runs as the routed "
                   "experts' last group (kernels.fuse_shared_expert); the bf16 and fp8 engines alike")
    p.add_argument("--no-vae", action="store_true")
    p.add_argument("--vae-dtype", choices=["float32", "float16", "bfloat16"], default="float16",
                   help="the decode whose time enters the per-image figure (all three are timed and compared); "
                        "float16 autocast is the official pipeline's")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--floor-rounds", type=int, default=1, metavar="N",
                   help="time the fp8 floor's kernels alone N times in all (rotating their order), to report the "
                   "spread of the floor timed alone and of the engine's ratio to it; the first pass stays the floor")
    p.add_argument("--json", type=Path)
    p.add_argument("--platform", default="cuda", help="cpu with --config small: a dry run of the script")
    p.add_argument("--config", choices=["released", "small"], default="released",
                   help="small: hidden 256, 4 experts (dry runs only)")
    return p.parse_args(argv)


def engine(a, platform, quant, device, out, label):
    s = Setup(a, platform, quant, device)
    sync()
    s.prefill()
    sync()
    t_prefill = median_seconds(s.prefill, 3, warmup=1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_step_eager = median_seconds(lambda: s.step(False), a.timed)
    x = s.block_input(torch.full((1,), 900.0, device=device))
    t_bb_eager = median_seconds(lambda: s.backbone(x), a.timed)
    layer0 = s.model.model.layers[0]
    layer_bytes = sum(t.numel() * t.element_size() for t in list(layer0.parameters()) + list(layer0.buffers()))
    res = out[f"engine_{label}"] = {
        "quant": quant, "moe_kernel": layer0.mlp.experts.moe.name,
        "attention_kernel": layer0.self_attn.attn["none"].name, "linear_kernel": layer0.self_attn.qkv_proj.kernel.name,
        "prefill_s": t_prefill, "prefill_32_layers_s": t_prefill / a.layers * RELEASED_LAYERS,
        "step_eager_s": t_step_eager, "backbone_eager_s": t_bb_eager, "per_layer_eager_s": t_bb_eager / a.layers,
        "image_io_eager_s": t_step_eager - t_bb_eager,
        "step_32_layers_eager_s": t_bb_eager / a.layers * RELEASED_LAYERS + t_step_eager - t_bb_eager,
        "weight_bytes_per_layer": layer_bytes,
    }
    res.update(step_32_layers_s=res["step_32_layers_eager_s"], image_io_s=res["image_io_eager_s"], mode="eager")
    print(f"[engine {label}] eager: step {t_step_eager*1e3:.1f} ms ({a.layers} layers), per layer "
          f"{t_bb_eager/a.layers*1e3:.2f} ms, kernels {res['moe_kernel']} / {res['attention_kernel']}", flush=True)
    try:
        s.graphs = StepGraphs(platform, platform.info.device_type)
        s.step(True)
        t_step_graph = median_seconds(lambda: s.step(True), a.timed)
        @torch.inference_mode()
        def replay_backbone():
            return s.graphs.run(s.graph_key, x, s.model.backbone, None)

        t_bb_graph = median_seconds(replay_backbone, a.timed)
        io = t_step_graph - t_bb_graph
        res.update(step_graph_s=t_step_graph, backbone_graph_s=t_bb_graph, per_layer_graph_s=t_bb_graph / a.layers,
                   image_io_s=io, step_32_layers_s=t_bb_graph / a.layers * RELEASED_LAYERS + io, mode="graph",
                   captures=s.graphs.captures, replays=s.graphs.replays)
        print(f"[engine {label}] graph: step {t_step_graph*1e3:.1f} ms, per layer {t_bb_graph/a.layers*1e3:.2f} ms, "
              f"image io {io*1e3:.1f} ms", flush=True)
    except Exception as err:
        out.setdefault("errors", {})[f"graph_{label}"] = f"{type(err).__name__}: {err}"
        print(f"[engine {label}] graph capture FAILED, eager figures stand: {type(err).__name__}: {err}", flush=True)
        traceback.print_exc()
        s.graphs = None
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    kv_layer = s.pool.k[0].numel() * s.pool.k[0].element_size() * 2
    res["peak_mem_gib_measured_layers"] = peak / 2**30
    res["peak_mem_gib_32_layers_estimate"] = (peak + (RELEASED_LAYERS - a.layers) * (layer_bytes + kv_layer)) / 2**30
    print(f"[engine {label}] peak {peak/2**30:.1f} GiB with {a.layers} layers; "
          f"~{res['peak_mem_gib_32_layers_estimate']:.1f}"
          f" GiB estimated for 32 (+ weights and KV of the other layers)", flush=True)
    return s, res


# ----------------------------------------------------------------- quality, VAE


def quality(s16: Setup, s8: Setup, out):
    t = torch.full((1,), 900.0, device=s16.device)
    with torch.inference_mode():
        x = s16.block_input(t)
        h16, h8 = s16.backbone(x), s8.backbone(x)
        _, v16 = s16.step(False)
        _, v8 = s8.step(False)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    q = {"backbone_delta_rel_err": rel(h8 - x, h16 - x), "backbone_rel_err": rel(h8, h16),
         "prediction_rel_err": rel(v8, v16), "gate_backbone_rel_err_max": RANDOM_LAYERS_GATE}
    q["gate"] = "pass" if q["backbone_rel_err"] <= RANDOM_LAYERS_GATE else "FAIL"
    out["quality_random_layers"] = q
    print(f"[quality] fp8 vs bf16 on {s16.a.layers} random full-size layers: " +
          json.dumps(out["quality_random_layers"]), flush=True)


VAE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_pixels(x_B3HW: torch.Tensor) -> torch.Tensor:
    """The pipeline's denormalisation: [-1, 1] -> uint8 levels (as floats, for differences)."""
    return ((x_B3HW / 2 + 0.5).clamp(0, 1) * 255).round()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0 ** 2 / mse)).item()


def vae_decode(s: Setup, out, per_image: str):
    """1024x1024 decode in fp32 and under fp16 / bf16 autocast (the official pipeline's is fp16); each
    low-precision image is compared with the fp32 one in uint8 levels. ``per_image`` enters the image figure."""
    from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig

    with torch.device(s.device):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(s.cfg.vae)).eval()
    random_init_(vae, 0)
    vae.prepare(channels_last=s.model.channels_last, group_norm_kernel=s.model.group_norm_kernel)  # as the engine
    lat = s.latents.float()
    ref = to_pixels(vae.decode_image(lat, dtype=torch.float32))
    res = {}
    for name, dtype in VAE_DTYPES.items():
        t = median_seconds(lambda: vae.decode_image(lat, dtype=dtype), 3, warmup=1)
        px = to_pixels(vae.decode_image(lat, dtype=dtype))
        res[name] = {"s": t, "finite": bool(px.isfinite().all()), "psnr_vs_fp32_db": psnr(px, ref),
                     "max_level_diff": float((px - ref).abs().max()),
                     "levels_off_by_more_than_2_frac": float(((px - ref).abs() > 2).float().mean())}
        print(f"[vae] decode 1024x1024 {name}: {t*1e3:.1f} ms, vs fp32 {json.dumps(res[name])}", flush=True)
    out["vae_decode"] = res
    out["vae_decode_dtype"] = per_image
    out["vae_decode_s"] = res[per_image]["s"]
    vae = None  # frees the VAE before the caller's next part


def main():
    a = parse()
    platform = select(a.platform)
    dev = platform.device_services(0).device
    out = {"note": f"RANDOM weights, released widths, {a.layers} of 32 layers measured; per-layer times x 32 "
                   f"(+ per-step image I/O) give the 32-layer figures",
           "device": platform.info.device_name, "torch": torch.__version__, "layers": a.layers, "size": a.size,
           "prefix": a.prefix, "rows": 2, "steps": a.steps, "cfg": 5.0, "argv": sys.argv[1:],
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": git_commit()}

    def save():
        if a.json:
            a.json.write_text(json.dumps(out, indent=2))

    def attempt(name, fn):
        try:
            return fn()
        except Exception as err:  # a part that fails is reported, the rest still runs
            out.setdefault("errors", {})[name] = f"{type(err).__name__}: {err}"
            print(f"[{name}] FAILED: {type(err).__name__}: {err}", flush=True)
            traceback.print_exc()
        finally:
            save()

    s8, _ = attempt("engine_fp8", lambda: engine(a, platform, a.quant, dev, out, "fp8")) or (None, None)
    if s8 is not None and not a.no_profile:
        if s8.graphs is not None:
            attempt("profile_fp8_graph", lambda: profile(s8, out, "fp8_graph", graph=True))
        attempt("profile_fp8", lambda: profile(s8, out, "fp8"))
        attempt("profile_io_fp8", lambda: profile_io(s8, out, "fp8"))
    s16, _ = attempt("engine_bf16", lambda: engine(a, platform, "none", dev, out, "bf16")) or (None, None)
    if s16 is not None and not a.no_profile:
        attempt("profile_bf16", lambda: profile(s16, out, "bf16"))
    if s8 is not None and s16 is not None:
        attempt("quality", lambda: quality(s16, s8, out))
    if a.no_naive and a.no_vae:
        s16 = None  # nothing after the floor uses the bf16 model: its 41 GiB (8 layers) go to the floor (an H100)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if s8 is not None:
        s8.graphs = None
        attempt("floor", lambda: floor(a, s8, out, platform))
    s8 = None  # frees the fp8 model before the naive bf16 run
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if s16 is not None and not a.no_naive:
        s16.graphs = None
        attempt("naive", lambda: naive(a, s16, out))
    if not a.no_vae and s16 is not None:
        attempt("vae", lambda: vae_decode(s16, out, a.vae_dtype))
    summarize(a, out)
    save()


def summarize(a, out):
    vae = out.get("vae_decode_s", 0.0)
    lines = [f"== {out['device']}, {a.size}, {a.steps} steps, CFG 5, prefix {a.prefix}; RANDOM weights; "
             f"{a.layers} layers measured, extrapolated to 32 =="]
    fl = out.get("floor", {})
    flops_step = fl.get("flops_per_layer", {}).get("total", 0) * RELEASED_LAYERS
    summary = {}
    for key, label in (("engine_fp8", "engine fp8"), ("engine_bf16", "engine bf16"), ("naive_bf16", "naive bf16")):
        r = out.get(key)
        if not r:
            continue
        step = r.get("step_32_layers_s")
        prefill = r.get("prefill_32_layers_s", 0.0)
        image = prefill + a.steps * step + vae
        summary[key] = {"step_32_s": step, "image_s": image}
        mfu = ""
        if flops_step:
            prec = "fp8" if key == "engine_fp8" else "bf16"
            mfu = f", {flops_step / (step - r.get('image_io_s', 0)) / 1e12:.0f} TFLOP/s in the backbone " \
                  f"(MFU {flops_step / (step - r.get('image_io_s', 0)) / PEAK[prec] * 100:.0f}% of {prec} peak)"
        lines.append(f"{label:12s}: step {step*1e3:7.1f} ms, image {image:6.2f} s{mfu}")
    for prec in ("fp8", "bf16"):
        if prec in fl:
            f = fl[prec]
            lines.append(f"floor {prec:5s}: step {f['step_32_layers_s']*1e3:7.1f} ms, image {f['image_s']:6.2f} s "
                         f"(GEMMs {f['gemm_tflops']:.0f} TFLOP/s, attention {f['attention_tflops']:.0f} TFLOP/s)")
    e8, nv = summary.get("engine_fp8"), summary.get("naive_bf16")
    if e8 and nv:
        lines.append(f"naive / engine fp8 = {nv['image_s'] / e8['image_s']:.1f}x")
    if e8 and "fp8" in fl:
        lines.append(f"engine fp8 / floor fp8 = {e8['step_32_s'] / fl['fp8']['step_32_layers_s']:.2f}x (per step)")
        rounds = fl["fp8"].get("alone_rounds")
        if rounds:
            ratios = [e8["step_32_s"] / t for t in rounds["step_32_layers_s"]]
            lines.append(f"engine fp8 / floor fp8 over {len(ratios)} rounds of the floor alone = "
                         f"{min(ratios):.3f}-{max(ratios):.3f}x (median {statistics.median(ratios):.3f}x)")
        cap = fl["fp8"].get("captured_alone")
        if cap:
            lines.append(f"engine fp8 / floor fp8 captured alone = {e8['step_32_s'] / cap['step_32_layers_s']:.3f}x "
                         f"(each kernel in a graph of its own: {cap['step_32_layers_s']*1e3:.1f} ms a step)")
        sus = fl["fp8"].get("sustained")
        if sus:
            lines.append(f"engine fp8 / sustained floor fp8 = {e8['step_32_s'] / sus['step_32_layers_s']:.2f}x "
                         f"(floor kernels replayed back to back: {sus['step_32_layers_s']*1e3:.1f} ms a step)")
    e16 = summary.get("engine_bf16")
    if e16 and "bf16" in fl:
        lines.append(f"engine bf16 / floor bf16 = {e16['step_32_s'] / fl['bf16']['step_32_layers_s']:.2f}x (per step)")
    lines.append(f"VAE decode ({out.get('vae_decode_dtype', '-')}) {vae*1e3:.0f} ms included per image; peak memory "
                 f"{out.get('engine_fp8', {}).get('peak_mem_gib_measured_layers', float('nan')):.1f} GiB "
                 f"({a.layers} layers, fp8)")
    out["summary"] = summary
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
