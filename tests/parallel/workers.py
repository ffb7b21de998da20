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


def host_share(ctx):
    """What this rank reads as the ranks on its host, and the Triton compile threads that gives the cuda
    platform (its compile pool's default; the module imports no Triton until it compiles)."""
    from omni.platforms.cuda.triton_compile import workers as compile_workers

    return os.environ.get("LOCAL_WORLD_SIZE"), compile_workers({k: v for k, v in os.environ.items()
                                                                 if k != "OMNI_COMPILE_WORKERS"})


def driver_job(ctx, checkpoint: str, prompts: list[str], follower_ballast_mib: int = 0):
    """One multi-rank replica serving through the Engine on its first rank; the other ranks follow. The other
    ranks first touch ``follower_ballast_mib`` MiB (their peak memory rises by that much); the driver's results
    carry ``DriverPipeline.memory_by_rank()`` under ``"_memory_by_rank"``."""
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
        torch.ones(follower_ballast_mib << 18).sum()  # 4-byte elements: the pages count in this rank's peak
        return {"followed": follow(pipe, control)}
    driver = DriverPipeline(pipe, control)
    try:
        reqs = [ImageRequest(prompt=p, steps=3, seed=7 + i, request_id=f"r{i}") for i, p in enumerate(prompts)]
        reqs.append(ImageRequest(prompt="no seed given", steps=3, seed=None, request_id="unseeded"))
        results = Engine(driver).run(reqs)
    finally:
        driver.close()
    return {r.request_id: (r.image_HW3, r.seed) for r in results} | {"_memory_by_rank": driver.memory_by_rank()}


class Poisoned:
    """The real pipeline, except that a request prompted "poison" fails here in ``op`` (admit or denoise_step)."""

    def __init__(self, pipeline, op: str):
        self.pipeline, self.op = pipeline, op

    def __getattr__(self, name):
        return getattr(self.pipeline, name)

    def _check(self, op: str, prompts) -> None:
        if op == self.op and "poison" in prompts:
            raise ValueError("poisoned request")

    def admit(self, req):
        self._check("admit", [req.prompt])
        return self.pipeline.admit(req)

    def denoise_step(self, states) -> None:
        self._check("denoise_step", [s.request.prompt for s in states])
        self.pipeline.denoise_step(states)


def poisoned_driver_job(ctx, checkpoint: str, prompts: list[str], poisoned_ranks: tuple[int, ...], op: str):
    """A cfg2 replica under the scheduler where the "poison" request fails in ``op`` on ``poisoned_ranks``.

    Returns, on the driver, each request's image or its error message (the others keep serving).
    """
    from omni.parallel.driver import DriverPipeline, follow
    from omni.parallel.runtime import ParallelRuntime
    from omni.recipe import load_recipe
    from omni.request import ImageRequest
    from omni.scheduler import Scheduler
    from omni.models.hunyuan_image3.build import build_pipeline

    pipe = build_pipeline(load_recipe("cpu_tiny"), ctx.platform, model_path=checkpoint, progress=False,
                          parallel=ParallelRuntime(ctx.mesh, ctx.platform))
    control = ctx.mesh.control("replica")
    if control.rank in poisoned_ranks:
        pipe = Poisoned(pipe, op)
    if control.rank != 0:
        return {"followed": follow(pipe, control)}
    driver = DriverPipeline(pipe, control)
    try:
        sched = Scheduler(driver, max_running=4)
        tickets = [sched.submit(ImageRequest(prompt=p, steps=3, seed=7 + i, request_id=f"r{i}"))
                   for i, p in enumerate(prompts)]
        while sched.has_work():
            sched.step()
    finally:
        driver.close()
    return {t.request_id: (str(t.future.exception()) if t.future.exception() else t.future.result().image_HW3)
            for t in tickets}


def capture_report(ctx, labels: list[str]) -> dict:
    """Per layout of this world size: (why its step cannot be captured, the backend of its step's collectives)."""
    from omni.parallel.mesh import Degrees, Mesh
    from omni.parallel.runtime import ParallelRuntime

    out = {}
    for label in labels:
        degrees = Degrees.parse(label)
        mesh = ctx.mesh if degrees == ctx.degrees else Mesh.build(degrees, platform=ctx.platform)
        runtime = ParallelRuntime(mesh, ctx.platform)
        out[label] = (runtime.capture_refusal(), runtime.step_collectives)
    return out


def binding_report(ctx) -> tuple:
    """(rank, the local device it bound, the process group's backend)."""
    import torch.distributed as dist

    return ctx.rank, ctx.info.local_device, dist.get_backend()


def sharing_report(ctx) -> tuple:
    """(whether this rank shares its device, the OMNI_TEST_SHARED variable it found after init)."""
    import os

    return ctx.info.shares_device, os.environ.get("OMNI_TEST_SHARED")


class PassScope:
    """A compile scope double (what a just-in-time platform's ``omni_compile_scope`` returns): counts entries and
    exits."""

    def __init__(self):
        self.entered = self.left = 0

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc):
        self.left += 1
        return False


def compile_pass_driver_job(ctx, checkpoint: str, prompt: str):
    """A cfg2 replica whose driver warms up with ``compile_first`` on a platform with a (double) compile scope,
    then serves ``prompt``. Each rank returns its scope's entries and exits and, per model call it ran, whether a
    compile pass was on; the driver also the image."""
    from omni import compile_pass
    from omni.parallel.driver import DriverPipeline, follow
    from omni.parallel.runtime import ParallelRuntime
    from omni.recipe import load_recipe
    from omni.request import ImageRequest
    from omni.scheduler import Scheduler, default_request
    from omni.models.hunyuan_image3.build import build_pipeline

    scope, seen = PassScope(), []
    ctx.platform.pm.register(_jit_double(scope), name="jit-double")
    recipe = load_recipe("cpu_tiny")
    pipe = build_pipeline(recipe, ctx.platform, model_path=checkpoint, progress=False,
                          parallel=ParallelRuntime(ctx.mesh, ctx.platform))
    step = pipe.denoise_step

    def watched_step(states):
        seen.append(compile_pass.active())
        step(states)

    pipe.denoise_step = watched_step
    control = ctx.mesh.control("replica")
    if control.rank != 0:
        return {"followed": follow(pipe, control), "scope": (scope.entered, scope.left), "steps": seen}
    driver = DriverPipeline(pipe, control)
    try:
        sched = Scheduler(driver, compile_first=True)
        sched.warm_up(default_request(recipe, steps=2))
        ticket = sched.submit(ImageRequest(prompt=prompt, steps=3, seed=7, request_id="r0"))
        while not ticket.future.done():
            sched.step()
    finally:
        driver.close()
    return {"image": ticket.result().image_HW3, "scope": (scope.entered, scope.left), "steps": seen}


def _jit_double(scope: PassScope):
    """A plugin answering ``omni_compile_scope`` with ``scope``."""
    from omni.hookspecs import hookimpl

    class Jit:
        @hookimpl
        def omni_compile_scope(self, info):
            return scope

    return Jit()
