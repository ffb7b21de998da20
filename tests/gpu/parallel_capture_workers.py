"""Launcher targets of tests/gpu/test_gpu_parallel_capture.py (importable by name in spawned workers)."""
from __future__ import annotations

import torch

CHANGES = {"platform": "cuda", "device.kind": "h200", "model.dtype": "bfloat16", "kv_cache.mode": "contiguous"}


def tiny_engine(platform, graph_mode: str, parallel=None, device_index: int = 0, dtype: str = "bfloat16"):
    """The embedded tiny text-to-image pipeline on CUDA device ``device_index``, eager or captured."""
    from omni.models.hunyuan_image3.build import build_pipeline
    from omni.recipe import load_recipe

    recipe = load_recipe("cpu_tiny").replace_paths({**CHANGES, "graph.mode": graph_mode, "model.dtype": dtype})
    return build_pipeline(recipe, platform, progress=False, parallel=parallel, local_rank=device_index)


@torch.inference_mode()
def generate(engine, steps: int = 3, seed: int = 5) -> dict:
    """One CFG request (two rows) stepped ``steps`` times: its latents and the step graphs' counters."""
    from omni.request import ImageRequest

    s = engine.admit(ImageRequest(prompt="a red cat on green grass", height=128, width=128, steps=steps,
                                  guidance=5.0, seed=seed))
    engine.prefill([s])
    while s.step < steps:
        engine.denoise_step([s])
    g = engine.step_graphs
    out = {"latents": s.latents_1Chw.float().cpu(), "rows_here": len(s.rows),
           "graphs": None if g is None else (g.captures, g.replays)}
    engine.release(s)
    return out


def layout_run(ctx, graph_mode: str) -> dict:
    """This rank's run of ``generate`` under the launch's layout."""
    from omni.parallel.runtime import ParallelRuntime

    runtime = ParallelRuntime(ctx.mesh, ctx.platform)  # on the device the launcher bound (one each, or shared)
    return generate(tiny_engine(ctx.platform, graph_mode, runtime, device_index=ctx.info.local_device))


def nccl_step_graph(ctx) -> dict:
    """A step graph whose region issues an NCCL all-reduce (a group of the whole job), against its eager run."""
    import torch.distributed as dist

    from omni.step_graphs import StepGraphs

    graphs = StepGraphs(ctx.platform, "cuda", collectives=dist.get_backend())
    dev = ctx.device  # this rank's GPU: torch.cuda.current_device() after the launcher bound it
    w = torch.randn(64, 64, device=dev, generator=torch.Generator(dev).manual_seed(1))

    def forward(x, w):
        y = torch.tanh(x @ w)
        dist.all_reduce(y)  # the tp all-reduce's shape of work: in place, on the step's stream
        return y * 0.5 + 1.0

    errs = []
    for i in range(3):
        x = torch.randn(32, 64, device=dev, generator=torch.Generator(dev).manual_seed(10 + i))
        got = graphs.run(((("sig",),), ()), x, forward, lambda: (w,)).clone()
        errs.append((got - forward(x, w)).abs().max().item())
    return {"backend": dist.get_backend(), "world": dist.get_world_size(), "errs": errs,
            "graphs": (graphs.captures, graphs.replays)}


def driver_memory_run(ctx, ballast_mib: int) -> dict:
    """A cfg2 replica serving one request through ``DriverPipeline`` (tests/gpu/test_gpu_replica_memory.py): the
    driver returns ``memory_by_rank()``; the follower holds ``ballast_mib`` MiB more device memory while it
    follows and returns its own ``memory_stats()``."""
    from omni.engine import Engine
    from omni.parallel.driver import DriverPipeline, follow
    from omni.parallel.runtime import ParallelRuntime
    from omni.request import ImageRequest

    pipe = tiny_engine(ctx.platform, "eager", ParallelRuntime(ctx.mesh, ctx.platform),
                       device_index=ctx.info.local_device)
    control = ctx.mesh.control("replica")
    if control.rank != 0:
        ballast = torch.empty(ballast_mib << 20, dtype=torch.uint8, device=ctx.device)
        follow(pipe, control)
        return {"own": pipe.memory_stats(), "ballast_bytes": ballast.numel()}
    driver = DriverPipeline(pipe, control)
    try:
        Engine(driver).run([ImageRequest(prompt="a red cat", height=128, width=128, steps=2, guidance=5.0, seed=5)])
    finally:
        driver.close()
    return {"by_rank": driver.memory_by_rank()}
