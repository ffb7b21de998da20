"""Step cache (TeaCache-style) on the embedded tiny model: denoise speed-up against image quality.

Prompt i is generated with seed + i (on the tiny model the seed moves the image
far more than the prompt) once per threshold, on one pipeline built and warmed
up once. Threshold 0 (cache off) is the reference: every image is compared with
its prompt's no-cache image by PSNR (dB) and SSIM (``omni.image_quality``, data
range 255). Speed-up = no-cache denoise time / cached denoise time, summed over
prompts (a prompt's thresholds run back to back, so drifting host load hits
them alike); wall s/image (prefill, denoise, VAE) is shown too. The first and
last steps always run: at most steps - 2 skip. ``--size`` only picks the
aspect: it snaps to a ~1 MPixel row of the model's table (512x512 also makes
1024x1024). The tiny model's weights are random, so the numbers show the
threshold's trade-off on this model, not the released model's image quality.

    python bench/bench_step_cache.py                      # 3 prompts, 50 steps, 1024x1024, CPU
    python bench/bench_step_cache.py --steps 20 --thresholds 0,0.1,0.3 --threads 1 --json out.json

Prints a markdown table; ``--json PATH`` also writes every measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_commit  # noqa: E402

from omni.engine import Engine  # noqa: E402
from omni.image_quality import psnr, ssim  # noqa: E402
from omni.deployment import prepare  # noqa: E402
from omni.recipe import parse_size  # noqa: E402
from omni.request import ImageRequest  # noqa: E402

PROMPTS = ["a red fox in fresh snow, morning light", "an isometric city block at night, neon signs",
           "a bowl of ramen on a wooden table", "a lighthouse on a cliff during a storm"]


def build(cache_dir: Path | None = None):
    """The cpu_tiny deployment's pipeline; ``cache_dir``: where the embedded checkpoint is written
    (default: the cache)."""
    from omni.models.hunyuan_image3.tiny import ensure_tiny_checkpoint

    overrides = {"model.path": str(ensure_tiny_checkpoint(cache_dir))} if cache_dir else {}
    return prepare("cpu_tiny", platform="cpu", overrides=overrides).build_pipeline(progress=False)


def generate(pipe, prompt: str, threshold: float, steps: int, width: int, height: int, seed: int = 7):
    """One image: (uint8 HxWx3 tensor, StageTimes, wall seconds)."""
    req = ImageRequest(prompt=prompt, height=height, width=width, steps=steps, seed=seed, step_cache=threshold)
    t0 = time.perf_counter()
    out = Engine(pipe).run([req])[0]
    return torch.from_numpy(out.image_HW3), out.times, time.perf_counter() - t0


def measure(pipe, prompts: list[str], thresholds: list[float], steps: int, width: int, height: int,
            seed: int = 7, warmup: bool = True) -> list[dict]:
    """One row per threshold (threshold 0, the reference, is added first if missing); prompt i uses seed + i."""
    thresholds = [0.0] + [t for t in thresholds if t != 0]
    if warmup:  # allocator, thread pools, first-call costs at this shape
        generate(pipe, prompts[0], 0.0, 2, width, height)
    runs = {t: [] for t in thresholds}
    for i, prompt in enumerate(prompts):
        ref = None
        for t in thresholds:
            img, times, wall = generate(pipe, prompt, t, steps, width, height, seed + i)
            ref = img if ref is None else ref
            runs[t].append(record(prompt, seed + i, times, wall, quality(img, ref)))
            print(f"  {prompt[:24]!r} threshold {t:g}: {times.steps_skipped} skipped, denoise {times.denoise:.2f} s, "
                  f"PSNR {runs[t][-1]['psnr_db']:.1f} dB", file=sys.stderr, flush=True)
    base = sum(r["denoise_s"] for r in runs[0.0])
    return [summarize(t, steps, base, runs[t]) for t in thresholds]


def record(prompt: str, seed: int, times, wall: float, metrics: dict) -> dict:
    return {"prompt": prompt, "seed": seed, "skipped": times.steps_skipped, "denoise_s": times.denoise,
            "vae_s": times.vae, "prefill_s": times.prefill, "wall_s": wall, **metrics}


def quality(img: torch.Tensor, ref: torch.Tensor) -> dict:
    """PSNR and SSIM against the reference; an identical image is inf / 1.0 without the (slow) SSIM pass."""
    if torch.equal(img, ref):
        return {"psnr_db": math.inf, "ssim": 1.0}
    return {"psnr_db": psnr(img, ref), "ssim": ssim(img, ref)}


def summarize(threshold: float, steps: int, base_denoise_s: float, runs: list[dict]) -> dict:
    denoise = sum(r["denoise_s"] for r in runs)
    mean = lambda k: sum(r[k] for r in runs) / len(runs)  # noqa: E731
    return {"threshold": threshold, "steps": steps, "skipped_min": min(r["skipped"] for r in runs),
            "skipped_max": max(r["skipped"] for r in runs), "denoise_speedup": base_denoise_s / denoise,
            "denoise_s_mean": mean("denoise_s"), "wall_s_mean": mean("wall_s"),
            "psnr_mean": mean("psnr_db"), "psnr_min": min(r["psnr_db"] for r in runs),
            "ssim_mean": mean("ssim"), "ssim_min": min(r["ssim"] for r in runs), "runs": runs}


def table(rows: list[dict]) -> str:
    def skipped(r):
        lo, hi = r["skipped_min"], r["skipped_max"]
        return f"{lo} of {r['steps']}" if lo == hi else f"{lo}-{hi} of {r['steps']}"

    lines = ["| threshold | steps skipped | denoise speed-up | denoise s/image | wall s/image | PSNR dB mean / min "
             "| SSIM mean / min |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['threshold']:g} | {skipped(r)} | {r['denoise_speedup']:.2f}x | {r['denoise_s_mean']:.2f} "
                     f"| {r['wall_s_mean']:.2f} | {r['psnr_mean']:.1f} / {r['psnr_min']:.1f} "
                     f"| {r['ssim_mean']:.4f} / {r['ssim_min']:.4f} |")
    return "\n".join(lines)


def finite(obj):
    """JSON without Infinity: an infinite PSNR (identical images) becomes null."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return None if isinstance(obj, float) and math.isinf(obj) else obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--size", default="1024x1024", help="WIDTHxHEIGHT (picks the aspect; snapped to ~1 MPixel)")
    p.add_argument("--thresholds", default="0,0.05,0.1,0.2,0.3,0.5", help="comma list; 0 (no cache) is the reference")
    p.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} built-in prompts")
    p.add_argument("--seed", type=int, default=7, help="prompt i uses seed + i")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch default)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    width, height = parse_size(args.size)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    started, t0 = git_commit(), time.perf_counter()  # the commit whose code is imported, before anyone moves HEAD
    rows = measure(build(), PROMPTS[: args.prompts], thresholds, args.steps, width, height, args.seed)
    total = time.perf_counter() - t0
    print(f"tiny HunyuanImage-3 (cpu_tiny) on CPU, {torch.get_num_threads()} threads: {args.prompts} prompts, "
          f"{args.steps} steps, {width}x{height}, seeds {args.seed}+i; reference = threshold 0; total {total:.0f} s\n")
    print(table(rows))
    if args.json:
        command = " ".join(["python", "bench/bench_step_cache.py", *(argv or sys.argv[1:])])
        out = {"benchmark": "bench_step_cache", "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "commit": started, "command": command, "torch": torch.__version__,
               "threads": torch.get_num_threads(), "recipe": "cpu_tiny", "steps": args.steps, "width": width,
               "height": height, "seed": args.seed, "prompts": PROMPTS[: args.prompts],
               "total_s": round(total, 1), "psnr_note": "null = identical to the reference (infinite PSNR)",
               "results": rows}
        Path(args.json).write_text(json.dumps(finite(out), indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
