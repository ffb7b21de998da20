"""``omni-run serve``: the engine thread plus uvicorn, from a checked recipe.

Startup order: uvicorn binds at once (GET /health answers 503 "starting"
while the model loads); the engine thread selects device services, builds
the pipeline and the scheduler, then /health turns 200. If the build fails
(a KV mode the platform's attention cannot serve, missing weights, ...) the
reason is logged and the process exits non-zero: a server that can never
be ready does not linger.
"""
from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from omni.scheduler import EngineLoop, Scheduler

from .app import ServingOptions, create_app

log = logging.getLogger("omni.serving")


def model_id_for(recipe, model_path: str | None = None) -> str:
    """The id /v1/models reports: the checkpoint directory's name, else the recipe's flavor."""
    path = model_path or recipe.model.path
    return Path(path).name if path else recipe.model.flavor


def scheduler_for(pipeline, recipe) -> Scheduler:
    s = recipe.serving
    sched = Scheduler(pipeline, max_running=s.max_running, max_queue=s.max_queue,
                      max_batch_tokens=s.max_batch_tokens)
    _warn_if_budget_below_one_request(sched, recipe)
    return sched


def _warn_if_budget_below_one_request(sched: Scheduler, recipe) -> None:
    from omni.request import ImageRequest

    w, h = recipe.defaults.width_height
    req = ImageRequest(prompt="x", height=h, width=w, guidance=recipe.defaults.guidance)
    cost = sched.cost(req)
    if cost.step_tokens > recipe.serving.max_batch_tokens:
        log.warning("serving.max_batch_tokens=%d is below one default %dx%d request (%d packed tokens): such "
                    "requests run one at a time; raise it to batch them", recipe.serving.max_batch_tokens, w, h,
                    cost.step_tokens)


def build_engine(recipe, platform, *, model_path: str | None = None) -> EngineLoop:
    """An EngineLoop whose thread builds the pipeline for ``recipe`` on ``platform`` (not started)."""

    def build() -> Scheduler:
        from omni.models.hunyuan_image3.build import build_pipeline

        pipeline = build_pipeline(recipe, platform, model_path=model_path, progress=False)
        return scheduler_for(pipeline, recipe)

    return EngineLoop(build)


def serve_main(args, recipe) -> int:
    """Serve ``recipe`` until interrupted. ``args``: platform, model, host, port, api_key, trace."""
    from omni.platform_manager import select

    platform = select(args.platform or recipe.platform, trace=getattr(args, "trace", False))
    host = getattr(args, "host", None) or recipe.serving.host
    port = getattr(args, "port", None) or recipe.serving.port
    engine = build_engine(recipe, platform, model_path=getattr(args, "model", None))
    options = ServingOptions.from_recipe(recipe, model_id=model_id_for(recipe, getattr(args, "model", None)),
                                         api_key=getattr(args, "api_key", None))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, options), host=host, port=port, log_level="info",
                                           timeout_graceful_shutdown=5))
    engine.start()

    def stop_if_dead(*_):
        if engine.status == "dead":
            server.should_exit = True

    _watch(engine, stop_if_dead)
    log.info("serving %s on http://%s:%d (platform %s, recipe %s); /health is 503 until the model is loaded",
             options.model_id, host, port, platform.name, recipe.name)
    try:
        server.run()
    finally:
        engine.stop()
    if engine.status == "dead":
        log.error("the engine failed: %s: %s", type(engine.error).__name__, engine.error)
        return 1
    return 0


def _watch(engine: EngineLoop, callback) -> None:
    """Call ``callback`` once the engine is ready or dead (from a helper thread)."""
    import threading

    threading.Thread(target=lambda: (engine.wait_ready(), callback()), name="omni-engine-watch", daemon=True).start()
