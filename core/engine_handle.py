"""The one engine handle the callers of a deployment use, whatever runs behind it.

``EngineHandle`` is what the HTTP app, ``omni-run generate`` and the bench
client talk to. Three classes implement it:

    omni.engine_loop.EngineLoop     the engine thread of this process (world size 1, or a replica's driver)
    omni.parallel.replica_link.RemoteReplica  one replica in other processes, over a connection
    omni.parallel.dp.ReplicaRouter  least-loaded routing over replicas (what a multi-rank deployment serves);
                                    the single-host path: across hosts, omni.serving.ray_serve runs one
                                    handle per Ray Serve replica

``open_engine(deployment)`` picks between the first and the last; none of
them gets attributes attached after construction.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable, Protocol, runtime_checkable

from .request import ImageRequest

log = logging.getLogger("omni.engine")

StepListener = Callable[[list, float], None]  # (tickets resolved in the step, its seconds)


@runtime_checkable
class TicketHandle(Protocol):
    """One submitted request: ``future`` resolves to an ``ImageResult`` (a ``TextResult`` for a
    ``TextRequest``) or the request's error. Local tickets (``omni.ticket.Ticket``) also stream a text
    answer so far through ``updates``; remote ones resolve only at the end."""

    request: ImageRequest
    future: concurrent.futures.Future

    @property
    def request_id(self) -> str: ...

    def result(self, timeout: float | None = None): ...


@runtime_checkable
class EngineHandle(Protocol):
    """Submit, cancel, watch readiness; ``status`` is starting, ready, dead or stopped (``error`` says why dead)."""

    status: str
    error: BaseException | None

    @property
    def ready(self) -> bool: ...

    @property
    def scheduler(self):
        """The local ``Scheduler`` (metrics read it at scrape time); None when requests run elsewhere."""

    def start(self) -> "EngineHandle": ...

    def stop(self, timeout: float | None = 30.0) -> None: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def unavailable_reason(self) -> str: ...

    def submit_many(self, reqs: list[ImageRequest]) -> list[TicketHandle]:
        """Queue ``reqs`` together or not at all (QueueFull, RequestTooLarge, EngineUnavailable)."""

    def cancel(self, ticket: TicketHandle) -> None: ...

    def load(self) -> int:
        """Outstanding requests (waiting + running): what the router balances."""

    def observe_steps(self, listener: StepListener) -> None:
        """Call ``listener`` after every engine step this handle runs in this process (none for remote ones)."""


def warm_up_request(deployment) -> ImageRequest | None:
    """The request a server warms up with (None when ``serving.warmup_steps`` is 0): ``served_request`` of
    ``serving.warmup_steps`` steps, so its prefix falls in the same captured-step bucket as the first users'."""
    steps = deployment.recipe.serving.warmup_steps
    return served_request(deployment, steps=steps) if steps else None


def served_request(deployment, **changes) -> ImageRequest:
    """The recipe's default request (with ``changes``) as the HTTP layer builds it: the size snapped by the
    flavour and the system-prompt mode (``defaults.system_prompt``, e.g. en_unified) resolved to its text."""
    from .scheduler import default_request

    recipe, helpers = deployment.recipe, deployment.flavor().serving_helpers()
    w, h = recipe.defaults.width_height
    h, w = helpers.snap(changes.pop("height", h), changes.pop("width", w))
    served = dict(height=h, width=w, system_prompt=helpers.system_prompt(recipe.defaults.system_prompt))
    return default_request(recipe, **(served | changes))


def warm_up_requests(deployment) -> tuple:
    """What a server warms up with: ``warm_up_request``; for a flavour that edits, the same request with one
    reference image of its size (``_warm_up_edit``); for a flavour that writes text, a short greedy answer:
    its decode steps (a few rows) compile their own kernel variants and capture their own graphs. At 32
    layers on the H200 after the image warm-up alone, the first 16-token answer took 7.79 s and the next 0.25 s;
    after this warm-up (6 s longer) the first took 0.24 s (BENCHMARKS.md, fourteenth session)."""
    from .request import TextRequest

    helpers = deployment.flavor().serving_helpers()
    image = warm_up_request(deployment)
    if image is None:
        return ()
    edit = (_warm_up_edit(image),) if helpers.max_images else ()
    if not helpers.writes_text:
        return (image, *edit)
    return image, *edit, TextRequest(prompt="describe a red fox", max_tokens=max(2, image.steps), temperature=0.0,
                                     seed=0, stop_ids=(), request_id="warm-up-answer")


def _warm_up_edit(image: ImageRequest) -> ImageRequest:
    """``image`` as an edit of one reference of its own size (a colour ramp): the prefill's reference encoders
    (ViT, VAE encoder) compile their kernels and the edit's longer prefix captures its step here, not in the
    first user's edit. On an H100 (h200_instruct_fp8 at 8 layers, compile pass on, one run each) the first edit
    of a 1024x1024 reference took 0.97 s of prefill (10 Triton binaries compiled) and 0.23 s of first step
    without it, 0.27 s and 0.07 s with it; the warm-up took 7.5 s instead of 6.0 (BENCHMARKS.md, thirty-sixth
    session). A server pays that once before it is ready; a user would pay the other."""
    import dataclasses

    return dataclasses.replace(image, prompt="make the sky orange", images=(colour_ramp(image.height, image.width),),
                               request_id="warm-up-edit")


def compile_ahead_request(deployment, req):
    """``req`` as the compile pass of a one-shot job runs it (``serving.compile_first``; ``omni-run generate``,
    ``edit`` and ``chat``): its own prompt, size and references, so that the prefill meets the kernels its prefix
    length and images select, with ``serving.warmup_steps`` denoising steps and as many CoT or answer tokens at
    most (2 at least), since every step after the first meets the same kernels and the pass's outputs are
    dropped. Without it the job's first run compiles each kernel as it reaches it, one after another: on an
    H100 (h200_fp8 at 8 layers, empty cache) the first image took 9.8-10.6 s, and 3.2 s after a 2.1 s pass
    that compiled the same 37 binaries together (BENCHMARKS.md, thirty-eighth session)."""
    import dataclasses

    steps = deployment.recipe.serving.warmup_steps
    tokens, request_id = max(2, steps), f"{req.request_id}-compile-ahead"
    if not isinstance(req, ImageRequest):  # a TextRequest: its answer's first tokens
        return dataclasses.replace(req, max_tokens=min(req.max_tokens, tokens), request_id=request_id)
    return dataclasses.replace(req, steps=min(req.steps, steps), cot_max_tokens=min(req.cot_max_tokens, tokens),
                               request_id=request_id)


def colour_ramp(height: int, width: int):
    """A smooth ``[height, width, 3]`` uint8 image (a linear ramp over its bytes): a reference image with no
    content, for warm-ups and first-use profiles."""
    import numpy as np

    return np.linspace(0, 255, height * width * 3, dtype=np.float32).reshape(height, width, 3).astype(np.uint8)


def serving_scheduler(pipeline, recipe, warm_up: tuple = (), *, build_s: float | None = None,
                      compile_ahead: tuple = ()):
    """``recipe.serving``'s scheduler over ``pipeline``, after running the ``warm_up`` requests to the end (the
    servers' engines: JIT compiles and graph captures happen before they report ready). ``build_s``: what
    building ``pipeline`` took, kept beside the warm-up's seconds for /metrics (``omni_startup_seconds``).
    ``compile_ahead``: requests the warm-up's compile pass runs too, and only it (``Scheduler.warm_up``)."""
    from .scheduler import Scheduler

    sched = Scheduler.from_recipe(pipeline, recipe)
    sched.build_s = build_s
    ahead = compile_ahead if sched.compile_first else ()
    if warm_up or ahead:
        names = [", ".join(type(r).__name__ for r in rs) + what for rs, what in (
            (warm_up, " (compiles and graph captures)"), (ahead, " through the compile pass only")) if rs]
        log.info("warm-up: %s ...", "; ".join(names))
        seconds = sched.warm_up(*warm_up, compile_ahead=ahead)
        if warm_up or sched.compile_pass_s is not None:  # else nothing ran (compile_pass logged why)
            within = "" if sched.compile_pass_s is None else f" (compile pass {sched.compile_pass_s:.1f} s of it)"
            log.info("warm-up done in %.1f s%s", seconds, within)
    return sched


def open_engine(deployment, *, progress: bool = False, warm_up: bool = False,
                random_layers: int = 0, compile_ahead: tuple = ()) -> EngineHandle:
    """The handle for ``deployment`` (not started): this process's engine loop, or launched replicas.

    World size 1: an ``EngineLoop`` whose thread builds the pipeline and the
    scheduler ``recipe.serving`` describes. World size > 1: every rank of the
    mesh is launched on this host (``omni.parallel.dp.start_replicas``) and
    the router over its dp replicas is returned once each replica's first rank
    connected, before they load: it reports starting until they are ready.
    ``warm_up``: the engine runs ``warm_up_requests`` before it reports ready (servers ask for it).
    ``compile_ahead``: requests only the compile pass runs before ready, where ``serving.compile_first``
    (``omni-run generate``: ``compile_ahead_request``).
    ``random_layers``: the released shapes with random values, that many layers (``omni-run bench
    --full-size-layers``); one process only, since launched ranks load the recipe's checkpoint.
    """
    from .engine_loop import EngineLoop
    from .scheduler import Scheduler

    if deployment.world_size > 1:
        from .parallel.dp import start_replicas

        if random_layers:  # exit 2 from the CLI (DeploymentError)
            from .deployment import DeploymentError

            raise DeploymentError(f"--full-size-layers builds one process's engine; recipe {deployment.recipe.name}"
                                  f" has world size {deployment.world_size}: bench/bench_parallel.py measures "
                                  "parallel layouts")
        return start_replicas(deployment, warm_up=warm_up, compile_ahead=compile_ahead)

    def build() -> Scheduler:
        t0 = time.perf_counter()
        pipeline = deployment.build_pipeline(progress=progress, random_layers=random_layers)
        return serving_scheduler(pipeline, deployment.recipe, warm_up_requests(deployment) if warm_up else (),
                                 build_s=time.perf_counter() - t0, compile_ahead=compile_ahead)

    return EngineLoop(build)
