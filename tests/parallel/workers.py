"""Launcher targets used by the launcher and serving tests (importable by name in spawned workers)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch


def fail_on_rank_one(ctx):
    """Rank 1 raises while rank 0 waits in a collective that can never complete."""
    import torch.distributed as dist

    if ctx.rank == 1:
        time.sleep(0.2)
        raise ValueError("boom on rank one")
    dist.barrier()
    return "unreachable"


def die_on_rank_one(ctx):
    """Rank 1 dies without a Python exception (as an OOM kill would)."""
    import torch.distributed as dist

    if ctx.rank == 1:
        os._exit(3)
    dist.barrier()


def sleeper(ctx, pid_dir: str):
    """Write this worker's pid, then sleep (a job to interrupt or orphan)."""
    Path(pid_dir, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def hosts_check(ctx):
    """All-reduce over tp and report where this rank runs (multi-host loopback tests)."""
    t = torch.tensor([float(ctx.rank + 1)])
    ctx.mesh.comm("tp").all_reduce(t)
    return f"rank={ctx.rank} node={ctx.info.node_rank} world={ctx.info.world_size} sum={t.item():g}"


def driver_job(ctx, checkpoint: str, prompts: list[str]):
    """One multi-rank replica serving through the Engine on its first rank; the other ranks follow."""
    from omni.engine import Engine
    from omni.parallel.driver import DriverPipeline, follow
    from omni.parallel.runtime import ParallelRuntime
    from omni.recipe import load_recipe
    from omni.request import ImageRequest
    from omni.models.hunyuan_image3.build import build_pipeline

    recipe = load_recipe("cpu_tiny")
    pipe = build_pipeline(recipe, ctx.platform, model_path=checkpoint, progress=False,
                          parallel=ParallelRuntime(ctx.mesh, ctx.platform))
    control = ctx.mesh.control("replica")
    if control.rank != 0:
        return {"followed": follow(pipe, control)}
    driver = DriverPipeline(pipe, control)
    try:
        reqs = [ImageRequest(prompt=p, steps=3, seed=7 + i, request_id=f"r{i}") for i, p in enumerate(prompts)]
        reqs.append(ImageRequest(prompt="no seed given", steps=3, seed=None, request_id="unseeded"))
        results = Engine(driver).run(reqs)
    finally:
        driver.close()
    return {r.request_id: (r.image_HW3, r.seed) for r in results}
