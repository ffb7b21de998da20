"""Packed step batching vs one request at a time: same requests, same scheduler, throughput ratio.

Both modes run the requests through ``omni.engine.Engine`` (the server's
scheduler, driven synchronously): "sequential" with max_running=1 (each
request alone, start to finish), "packed" with max_running=N (every running
request's rows in one varlen forward per step; requests of different sizes,
step counts and guidance join and leave at step boundaries). By default the
VAE decode is left out (it is per request in both modes and would dilute the
comparison); ``--decode`` includes it.

    python bench/bench_batching.py                                  # CPU, the embedded tiny model
    python bench/bench_batching.py --platform cuda --recipe h200_fp8 --full-size-layers 4
    python bench/bench_batching.py --platform cuda --recipe h200_fp8 --model /ckpt/HunyuanImage-3

Prints a table and writes JSON (``--json``, default bench_batching.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform as host
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import git_commit  # noqa: E402

from omni.engine import Engine  # noqa: E402
from omni.deployment import prepare  # noqa: E402
from omni.recipe import parse_bytes, parse_overrides, parse_size  # noqa: E402
from omni.request import ImageRequest  # noqa: E402

PROMPTS = ["a red fox in fresh snow, morning light", "an isometric city block at night, neon signs",
           "a bowl of ramen on a wooden table", "a lighthouse on a cliff during a storm",
           "a watercolor map of an imaginary island", "a close-up of a hummingbird at a flower",
           "a robot reading in a library", "a mountain lake at dawn with mist"]


class NoDecode:
    """The pipeline without the VAE: ``decode`` keeps the latents and returns a 1x1 image."""

    def __init__(self, pipeline):
        self.inner, self.latents = pipeline, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, state):
        self.latents[state.request.request_id] = state.latents_1Chw.float().cpu()
        return torch.zeros(1, 1, 3, dtype=torch.uint8)


def build(args, deployment):
    if args.full_size_layers:
        from random_model import build_random_pipeline

        return build_random_pipeline(deployment.recipe, deployment.platform(), num_layers=args.full_size_layers)
    return deployment.build_pipeline(progress=False)


def make_requests(args, tag: str) -> list[ImageRequest]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    out = []
    for i in range(args.requests):
        w, h = sizes[i % len(sizes)]
        out.append(ImageRequest(prompt=PROMPTS[i % len(PROMPTS)], height=h, width=w, steps=steps[i % len(steps)],
                                guidance=args.guidance, seed=1000 + i, request_id=f"{tag}{i}"))
    return out


def run_mode(pipeline, services, reqs: list[ImageRequest], max_running: int) -> dict:
    engine = Engine(pipeline, max_running=max_running)
    costs = [engine.scheduler.cost(r) for r in reqs]
    services.synchronize()
    services.reset_peak_memory()
    t0, c0 = time.perf_counter(), time.process_time()
    results = engine.run(reqs)
    services.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = engine.scheduler.stats
    request_steps = sum(r.steps for r in reqs)
    return {"max_running": max_running, "wall_s": round(wall, 4), "process_cpu_s": round(cpu, 3),
            "images": len(results),
            "images_per_s": round(len(results) / wall, 5), "request_steps_per_s": round(request_steps / wall, 4),
            "forwards": stats["steps"], "mean_requests_per_forward": round(request_steps / stats["steps"], 3),
            "packed_tokens_per_s": round(sum(c.step_tokens * r.steps for c, r in zip(costs, reqs)) / wall, 1),
            "peak_memory_bytes": services.max_memory_allocated(),
            "stage_s_sum": {k: round(sum(getattr(r.times, k) for r in results), 4)
                            for k in ("prefill", "denoise", "vae")}}


def _median(runs: list[dict]) -> dict:
    """The run with the median wall time (the whole record, so its numbers stay consistent)."""
    return sorted(runs, key=lambda m: m["wall_s"])[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", default="cpu")
    p.add_argument("--recipe", default=None, help="default: cpu_tiny on cpu, h200_fp8 otherwise")
    p.add_argument("--model", default=None, help="checkpoint directory (the real weights)")
    p.add_argument("--full-size-layers", type=int, default=0, metavar="N",
                   help="released shapes with N layers and random weights (no checkpoint)")
    p.add_argument("--requests", type=int, default=8, help="requests per mode (= max_running when packed)")
    p.add_argument("--sizes", default="1024x1024,1280x768,768x1280,1152x896", help="WxH list, cycled")
    p.add_argument("--steps", default="4", help="steps list, cycled (e.g. 4,6,8 mixes step counts)")
    p.add_argument("--guidance", type=float, default=5.0, help="> 1: two CFG rows per request")
    p.add_argument("--decode", action="store_true", help="include the VAE decode (per request in both modes)")
    p.add_argument("--kv-budget", default=None,
                   help="override kv_cache.budget_bytes (e.g. 256MiB, 40GiB); default: the recipe's on a device, "
                        "256MiB on the CPU (cpu_tiny's 16MiB holds two 1024px CFG requests)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, e.g. --set quant.scheme=none (repeatable)")
    p.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch default)")
    p.add_argument("--repeat", type=int, default=3, help="runs per mode, alternating; the median is reported")
    p.add_argument("--json", default="bench_batching.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = parse_overrides(args.set)
    if args.model:
        overrides["model.path"] = args.model
    if args.kv_budget is None and args.platform == "cpu":
        args.kv_budget = "256MiB"
    if args.kv_budget:
        overrides["kv_cache.budget_bytes"] = parse_bytes(args.kv_budget)
    deployment = prepare(args.recipe or ("cpu_tiny" if args.platform == "cpu" else "h200_fp8"), platform=args.platform,
                         overrides=overrides, random_weights=bool(args.full_size_layers))
    recipe = deployment.recipe
    services = deployment.platform().device_services(0)
    pipeline = build(args, deployment)
    pipeline = pipeline if args.decode else NoDecode(pipeline)
    need = sum(Engine(pipeline).scheduler.cost(r).pages for r in make_requests(args, "n"))
    if need > pipeline.pool.num_pages:
        raise SystemExit(f"{args.requests} requests need {need} KV pages, the pool has {pipeline.pool.num_pages}: "
                         "raise kv_cache.budget_bytes in the recipe or send fewer --requests")

    warm = [dataclasses.replace(r, steps=1) for r in make_requests(args, "w")]
    Engine(pipeline, max_running=1).run(warm[: len(args.sizes.split(","))])  # every shape alone, then packed
    Engine(pipeline, max_running=len(warm)).run([dataclasses.replace(r, request_id="v" + r.request_id) for r in warm])

    runs = {"sequential": [], "packed": []}
    for rep in range(args.repeat):  # alternate the modes so drifting load on a shared host hits both alike
        runs["sequential"].append(run_mode(pipeline, services, make_requests(args, f"s{rep}-"), max_running=1))
        runs["packed"].append(run_mode(pipeline, services, make_requests(args, f"p{rep}-"),
                                       max_running=args.requests))
    seq, packed = (_median(runs[k]) for k in ("sequential", "packed"))
    speedup = packed["images_per_s"] / seq["images_per_s"]
    paired = sorted(s["wall_s"] / p["wall_s"] for s, p in zip(runs["sequential"], runs["packed"]))
    paired_speedup = paired[len(paired) // 2]  # each repetition's back-to-back pair: robust to slow drifts
    best_speedup = min(m["wall_s"] for m in runs["sequential"]) / min(m["wall_s"] for m in runs["packed"])
    cpu_ratio = (sum(m["process_cpu_s"] for m in runs["sequential"]) /
                 sum(m["process_cpu_s"] for m in runs["packed"]))  # CPU seconds: insensitive to other tenants
    diff = rerun = None
    if isinstance(pipeline, NoDecode):
        lat = pipeline.latents
        diff = max(float((lat[f"s0-{i}"] - lat[f"p0-{i}"]).abs().max()) for i in range(args.requests))
        if args.repeat > 1:  # the noise floor: the same sequential run twice
            rerun = max(float((lat[f"s0-{i}"] - lat[f"s1-{i}"]).abs().max()) for i in range(args.requests))

    info = deployment.platform().info
    model = (f"released shapes, {args.full_size_layers} layers, random weights" if args.full_size_layers
             else recipe.model.path or recipe.model.flavor)
    out = {"benchmark": "bench_batching", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "commit": git_commit(), "command": " ".join(["python", "bench/bench_batching.py", *(argv or sys.argv[1:])]),
           "platform": info.name, "device": info.device_name or host.processor(), "threads": torch.get_num_threads(),
           "recipe": recipe.name, "model": model, "dtype": recipe.model.dtype, "quant": recipe.quant.scheme,
           "requests": args.requests, "sizes": args.sizes, "steps": args.steps, "guidance": args.guidance,
           "decode_included": args.decode, "repeat": args.repeat, "sequential": seq, "packed": packed,
           "speedup": round(speedup, 3), "speedup_paired_median": round(paired_speedup, 3),
           "speedup_best_of": round(best_speedup, 3), "process_cpu_s_ratio": round(cpu_ratio, 3),
           "wall_s_all_runs": {k: [m["wall_s"] for m in v] for k, v in runs.items()},
           "max_abs_latent_diff_packed_vs_sequential": diff, "max_abs_latent_diff_sequential_rerun": rerun}
    print(f"{model} on {out['device']} ({info.name}, {out['threads']} threads): {args.requests} requests, "
          f"sizes {args.sizes}, steps {args.steps}, guidance {args.guidance}, decode {'on' if args.decode else 'off'}")
    print(f"{'mode':<11}{'wall s':>9}{'images/s':>11}{'req-steps/s':>13}{'forwards':>10}{'req/fwd':>9}"
          f"{'peak GiB':>10}")
    for name, m in (("sequential", seq), ("packed", packed)):
        print(f"{name:<11}{m['wall_s']:>9.2f}{m['images_per_s']:>11.4f}{m['request_steps_per_s']:>13.3f}"
              f"{m['forwards']:>10}{m['mean_requests_per_forward']:>9.2f}{m['peak_memory_bytes'] / 2**30:>10.2f}")
    print(f"packed / sequential throughput: {speedup:.2f}x (paired median {paired_speedup:.2f}x, "
          f"best-of {best_speedup:.2f}x; process CPU seconds sequential/packed {cpu_ratio:.2f}x)" +
          ("" if diff is None else f"; max |latent diff| packed vs sequential: {diff:.3g}") +
          ("" if rerun is None else f" (sequential run twice: {rerun:.3g})"))
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
