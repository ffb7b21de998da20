"""``omni-run serve``: the engine thread plus uvicorn, from a checked recipe.

Startup order: uvicorn binds at once (GET /health answers 503 "starting"
while the model loads); the engine thread selects device services, builds
the pipeline and the scheduler, then /health turns 200. If the build fails
(a KV mode the platform's attention cannot serve, missing weights, ...) the
reason is logged and the process exits non-zero: a server that can never
be ready does not linger.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import uvicorn

from omni.engine_loop import EngineLoop
from omni.scheduler import Scheduler

from .app import ServingOptions, create_app

log = logging.getLogger("omni.serving")


class _Server(uvicorn.Server):
    """uvicorn, exiting with status 0 after a graceful shutdown on SIGINT / SIGTERM.

    Plain uvicorn re-raises the signal once it has drained, which turns an
    orderly stop into exit status 130 (or death by SIGTERM).
    """

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            getattr(self, "_captured_signals", []).clear()


def model_id_for(recipe, model_path: str | None = None) -> str:
    """The id /v1/models reports: the checkpoint directory's name, else the recipe's flavor."""
    path = model_path or recipe.model.path
    return Path(path).name if path else recipe.model.flavor


def build_engine(recipe, platform, *, model_path: str | None = None) -> EngineLoop:
    """An EngineLoop whose thread builds the pipeline for ``recipe`` on ``platform`` (not started)."""

    def build() -> Scheduler:
        from omni.models.hunyuan_image3.build import build_pipeline

        pipeline = build_pipeline(recipe, platform, model_path=model_path, progress=False)
        return Scheduler.from_recipe(pipeline, recipe)

    return EngineLoop(build)


def serve_main(args, recipe) -> int:
    """Serve ``recipe`` until interrupted. ``args``: platform, model, host, port, api_key, trace."""
    from omni.platform_manager import select

    platform = select(args.platform or recipe.platform, trace=getattr(args, "trace", False))
    host = getattr(args, "host", None) or recipe.serving.host
    port = getattr(args, "port", None) or recipe.serving.port
    engine = _engine_for(args, recipe, platform)
    # From here on the engine is stopped whatever happens: a multi-rank engine's ranks ignore Ctrl-C (the
    # server stops them), so an exception or a Ctrl-C before uvicorn takes over the signals must stop them too.
    try:
        options = ServingOptions.from_recipe(recipe, model_id=model_id_for(recipe, getattr(args, "model", None)),
                                             api_key=getattr(args, "api_key", None))
        server = _Server(uvicorn.Config(create_app(engine, options), host=host, port=port, log_level="info",
                                        timeout_graceful_shutdown=5))
        engine.start()

        def stop_if_dead(*_):
            if engine.status == "dead":
                server.should_exit = True

        _watch(engine, stop_if_dead)
        log.info("serving %s on http://%s:%d (platform %s, recipe %s); /health is 503 until the model is loaded",
                 options.model_id, host, port, platform.name, recipe.name)
        server.run()
    finally:
        engine.stop()
    if engine.status == "dead":
        log.error("the engine failed: %s: %s", type(engine.error).__name__, engine.error)
        return 1
    return 0


def _engine_for(args, recipe, platform):
    """One in-process engine, or (world size > 1) the router over launched multi-rank replicas."""
    if recipe.parallel.world_size == 1:
        return build_engine(recipe, platform, model_path=getattr(args, "model", None))
    from omni.parallel.dp import start_replicas

    log.info("launching %d ranks for %s", recipe.parallel.world_size, recipe.name)
    return start_replicas(getattr(args, "recipe", None) or recipe.name, platform=platform.name,
                          model_path=getattr(args, "model", None))


def _watch(engine: EngineLoop, callback) -> None:
    """Call ``callback`` once the engine is ready or dead (from a helper thread)."""
    import threading

    threading.Thread(target=lambda: (engine.wait_ready(), callback()), name="omni-engine-watch", daemon=True).start()
