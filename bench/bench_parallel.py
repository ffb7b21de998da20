"""Parallel layouts at full size: per-step time, communication share and peak memory per GPU.

The released HunyuanImage-3.0 widths (hidden 4096, 32/8 heads, 64 experts
top-8 of width 3072, vocab 133120) with ``--layers`` decoder layers and
random bf16 weights, sharded by the model's parallel plan exactly as a
checkpoint would be. The workload is the serving path: ``--batch`` requests
of ``--size`` with CFG (two rows each; ``<timestep>`` + 4096 image tokens per
row at 1024x1024) and a ``--prompt-tokens`` text prefix, prefilled once into
the KV pool (``--kv``), then denoising steps through ``omni.step_engine.StepEngine``
(which is where cfg2 exchanges predictions).

Per rank it reports:
  step_s            median wall time of one denoising step (device synchronised)
  comm_s            median time inside collectives per step (device events
                    around every collective; includes waiting for the peer)
  comm_share        comm_s / step_s
  nocomm_step_s     median step time of the comm-free variant (collectives
                    skipped: wrong numbers, same compute); 1 - nocomm/step is
                    the communication share measured by difference
  peak_mem_gib      torch peak allocated bytes on the device (weights + KV + activations)
and the 32-layer extrapolation (per-layer backbone time x 32 + image I/O).

    torchrun --nproc-per-node 2 bench/bench_parallel.py --layout tp2 --layers 8 --json tp2.json
    torchrun --nproc-per-node 2 bench/bench_parallel.py --layout cfg2 --layers 8 --json cfg2.json
    torchrun --nproc-per-node 2 bench/bench_parallel.py --layout tp2 --layers 8 --graph capture --json tp2_graph.json
    python bench/bench_parallel.py --layout tp2 --layers 8           # same, spawned by omni's launcher
    python bench/bench_parallel.py --layout single --layers 8        # one-GPU baseline
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_fullsize import random_init_  # noqa: E402

from omni.build_options import BuildOptions  # noqa: E402
from omni.kv_pool import KVPool  # noqa: E402
from omni.parallel.comm import CommStats  # noqa: E402
from omni.parallel.launch import RankInfo, launch, run_worker  # noqa: E402
from omni.parallel.mesh import Degrees  # noqa: E402
from omni.parallel.runtime import ParallelRuntime, SingleDevice  # noqa: E402
from omni.request import ImageRequest  # noqa: E402
from omni.step_engine import StepEngine  # noqa: E402
from omni.step_graphs import StepGraphs  # noqa: E402
from omni.models.hunyuan_image3.build import build_transformer, key_bucket  # noqa: E402
from omni.models.hunyuan_image3.config import HunyuanImage3Config  # noqa: E402
from omni.models.hunyuan_image3.pipeline import HunyuanImage3T2I  # noqa: E402
from omni.models.hunyuan_image3.tokenizer import Tokenizer  # noqa: E402

PROMPT_WORDS = "a red cat on green grass "  # six tokens of the tiny tokenizer (ids only feed the embedding)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", default="tp2", help="tp2, cfg2, single, or any mesh label (ulysses2, cfg2xtp2, ...)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (released: 32); ~4.8 GB bf16 per layer")
    p.add_argument("--platform", default="cuda")
    p.add_argument("--config", choices=["released", "tiny"], default="released",
                   help="released widths, or the embedded tiny model's (CPU smoke runs of this script)")
    p.add_argument("--size", default="1024x1024", help="WxH of each image")
    p.add_argument("--batch", type=int, default=1, help="requests packed per step (two CFG rows each)")
    p.add_argument("--prompt-tokens", type=int, default=300, help="text prefix length per row (about)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps (and as many comm-free steps)")
    p.add_argument("--quant", default="none")
    p.add_argument("--kv", choices=["paged", "contiguous"], default="contiguous",
                   help="contiguous (gathered keys) is what the h200 recipes use: FA3 serves it")
    p.add_argument("--page-tokens", type=int, default=256)
    p.add_argument("--no-comm-free", action="store_true", help="skip the comm-free variant")
    p.add_argument("--graph", choices=["eager", "capture"], default="eager",
                   help="capture: each rank replays its step from a device graph (tp's all-reduces recorded "
                        "inside it); collectives are then not timed one by one (events cannot be recorded "
                        "around them in a graph), so comm_s and the comm-free variant are left out")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def model_config(a) -> HunyuanImage3Config:
    """The chosen widths with ``a.layers`` decoder layers (per-layer lists cut or extended)."""
    import dataclasses

    from omni.models.hunyuan_image3.tiny import TINY_CONFIG

    cfg = HunyuanImage3Config.released() if a.config == "released" else HunyuanImage3Config.from_json_dict(TINY_CONFIG)
    per_layer = {k: (getattr(cfg, k) * a.layers)[:a.layers] for k in ("moe_topk", "moe_intermediate_size",
                                                                      "num_shared_expert")}
    return dataclasses.replace(cfg, num_hidden_layers=a.layers, **per_layer)


def build(ctx, a):
    services, platform = ctx.services, ctx.platform
    services.reset_peak_memory()
    cfg = model_config(a)
    runtime = ParallelRuntime(ctx.mesh, platform) if ctx.degrees.world_size > 1 else None
    paged = a.kv == "paged"
    capture = a.graph == "capture"
    opts = BuildOptions(dtype=torch.bfloat16, quant=a.quant, paged_kv=paged, page_size=a.page_tokens if paged else 0,
                        capturable=capture)
    model, _ = build_transformer(cfg, platform, opts, device=services.device, parallel=runtime)
    random_init_(model, seed=1234)  # same seed everywhere: replicated parts (router, norms) agree across ranks
    model.finalize()
    kv = cfg.num_key_value_heads if runtime is None else \
        runtime.pool_kv_heads(cfg.num_key_value_heads, cfg.num_attention_heads)
    w, h = (int(v) for v in a.size.split("x"))
    tokens = a.prompt_tokens + 16 + (h // 16) * (w // 16)
    pages = 2 * a.batch * (-(-tokens // a.page_tokens) + 1)
    pool = KVPool(num_layers=a.layers, num_pages=pages, page_size=a.page_tokens, num_kv_heads=kv,
                  head_dim=cfg.head_dim, dtype=torch.bfloat16, device=services.device)
    vae = types.SimpleNamespace(cfg=types.SimpleNamespace(latent_channels=cfg.latent_channels))
    t2i = HunyuanImage3T2I(transformer=model, vae=vae, tokenizer=Tokenizer.tiny(), config=cfg, device=services.device)
    runtime = SingleDevice() if runtime is None else runtime
    graphs = StepGraphs(platform, services.device.type, key_bucket=key_bucket(model),
                        collectives=runtime.step_collectives) if capture else None
    pipe = StepEngine(t2i, pool=pool, runtime=runtime, device=services.device, paged=paged, step_graphs=graphs)
    return pipe, model


def timed_steps(pipe, states, services, n: int, stats: CommStats) -> tuple[list[float], list[float]]:
    step_s, comm_s = [], []
    stats.calls = 0
    for _ in range(n):
        stats.collect()
        services.synchronize()
        t0 = time.perf_counter()
        pipe.denoise_step(states)
        services.synchronize()
        step_s.append(time.perf_counter() - t0)
        comm_s.append(stats.collect())
    return step_s, comm_s


@torch.inference_mode()
def bench_worker(ctx, a_dict: dict) -> dict:
    a = argparse.Namespace(**a_dict)
    services = ctx.services
    t0 = time.perf_counter()
    pipe, model = build(ctx, a)
    build_s = time.perf_counter() - t0
    weights_bytes = services.memory_stats().get("allocated_bytes", 0)
    capture = a.graph == "capture"
    stats = CommStats(services)
    ctx.mesh.instrument(None if capture else stats, enabled=True)  # no timing events inside a graph
    w, h = (int(v) for v in a.size.split("x"))
    prompt = PROMPT_WORDS * max(1, a.prompt_tokens // 6)
    total_steps = a.warmup + a.steps * 3 + 1
    reqs = [ImageRequest(prompt=prompt, height=h, width=w, steps=total_steps, guidance=5.0, seed=i,
                         request_id=f"bench{i}") for i in range(a.batch)]
    states = [pipe.admit(r) for r in reqs]
    services.synchronize()
    t0 = time.perf_counter()
    pipe.prefill(states)
    services.synchronize()
    prefill_s = time.perf_counter() - t0
    timed_steps(pipe, states, services, a.warmup, stats)
    step_s, comm_s = timed_steps(pipe, states, services, a.steps, stats)
    calls = stats.calls // max(1, a.steps)
    nocomm = []
    if not a.no_comm_free and not capture and ctx.degrees.world_size > 1:
        ctx.mesh.instrument(None, enabled=False)
        nocomm, _ = timed_steps(pipe, states, services, a.steps, stats)
        ctx.mesh.instrument(stats, enabled=True)
    backbone_s = float("nan") if capture else _backbone_only(pipe, states, services, a.steps)  # replays skip it
    med = statistics.median
    row = {"rank": ctx.rank, "device": str(services.device), "build_s": build_s, "prefill_s": prefill_s,
           "step_s": med(step_s), "step_s_all": step_s, "comm_s": None if capture else med(comm_s),
           "comm_share": None if capture else med(comm_s) / med(step_s), "collective_calls_per_step": calls,
           "graph": a.graph, "captures": None if pipe.step_graphs is None else pipe.step_graphs.captures,
           "nocomm_step_s": med(nocomm) if nocomm else None,
           "comm_share_by_difference": (1 - med(nocomm) / med(step_s)) if nocomm else None,
           "backbone_s": backbone_s, "per_layer_s": backbone_s / a.layers,
           "extrapolated_32_layer_step_s": backbone_s / a.layers * 32 + (med(step_s) - backbone_s),
           "weights_gib": weights_bytes / 2**30, "peak_mem_gib": services.max_memory_allocated() / 2**30,
           "attention_kernel": _kernel_name(model)}
    rows = ctx.mesh.comm("world").all_gather_object(row)
    prefix = states[0].rows[0].seq.prefix_len
    for s in states:
        pipe.release(s)
    return {"layout": ctx.degrees.label(), "layers": a.layers, "size": a.size, "batch": a.batch,
            "rows_per_step": 2 * a.batch, "prompt_tokens": prefix,
            "quant": a.quant, "kv": a.kv, "world": ctx.degrees.world_size, "platform": ctx.platform.name,
            "device_name": ctx.platform.info.device_name, "torch": torch.__version__,
            "dist_backend": ctx.platform.dist_backend(), "per_rank": rows}


def _backbone_only(pipe, states, services, n: int) -> float:
    """Median time of the decoder alone on one step's packed tokens (to split layers from image I/O)."""
    s = states[0]
    orig = pipe._backbone
    times = []

    def timed(*args, **kw):
        services.synchronize()
        t0 = time.perf_counter()
        out = orig(*args, **kw)
        services.synchronize()
        times.append(time.perf_counter() - t0)
        return out

    pipe._backbone = timed
    try:
        for _ in range(min(n, len(s.sigmas) - 1 - s.step)):
            pipe.denoise_step(states)
    finally:
        pipe._backbone = orig
    return statistics.median(times) if times else float("nan")


def _kernel_name(model) -> str:
    attn = model.model.layers[0].self_attn.attn["none"]
    return getattr(attn, "name", type(attn).__name__)


def report(result: dict, path: Path | None) -> None:
    graph = result["per_rank"][0].get("graph", "eager")
    print(f"\nlayout {result['layout']} ({graph})  layers {result['layers']}  "
          f"{result['size']} x {result['rows_per_step']} rows  "
          f"prefix {result['prompt_tokens']}  {result['device_name']}  {result['dist_backend']}")
    print(f"{'rank':>4} {'step ms':>9} {'comm ms':>9} {'comm %':>7} {'no-comm ms':>10} {'by diff %':>9} "
          f"{'peak GiB':>9} {'32-layer step s':>16}")
    for r in result["per_rank"]:
        nc = f"{r['nocomm_step_s'] * 1e3:10.1f}" if r["nocomm_step_s"] else f"{'-':>10}"
        bd = f"{r['comm_share_by_difference'] * 100:9.1f}" if r["comm_share_by_difference"] is not None else f"{'-':>9}"
        cm = (f"{r['comm_s'] * 1e3:9.1f} {r['comm_share'] * 100:7.1f}" if r["comm_s"] is not None
              else f"{'-':>9} {'-':>7}")  # captured steps: collectives not timed one by one
        print(f"{r['rank']:>4} {r['step_s'] * 1e3:9.1f} {cm} {nc} {bd} "
              f"{r['peak_mem_gib']:9.1f} {r['extrapolated_32_layer_step_s']:16.3f}")
    if path:
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


def main(argv=None) -> int:
    a = parse(argv)
    degrees = Degrees.parse(a.layout)
    info = RankInfo.from_env(os.environ)  # the entry point is the only place that reads the environment
    if info is not None:
        result = run_worker(bench_worker, info, degrees, platform=a.platform, args=(vars(a),))
        if info.rank == 0:
            report(result, a.json)
        return 0
    results = launch(bench_worker, degrees, platform=a.platform, args=(vars(a),))
    report(results[0], a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
