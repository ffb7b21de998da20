"""``omni-run serve``: the engine thread plus uvicorn, from a checked recipe.

Startup order: the endpoint's address is bound (a port in use or a host
that is not this machine's is refused at once, exit status 2, before any
weight loads); the deployment's engine handle is opened (world size > 1:
its ranks are launched and each replica's first rank connects, then they
load); uvicorn serves on the bound socket (GET /health
answers 503 "starting" while the model loads); the engine thread selects
device services, builds the pipeline and the scheduler, then /health turns 200. If the build fails
(a KV mode the platform's attention cannot serve, missing weights, ...) the
reason is logged and the process exits non-zero: a server that can never
be ready does not linger.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uvicorn

from omni.deployment import DeploymentError
from omni.engine_handle import EngineHandle

from .app import ServingOptions, create_app

log = logging.getLogger("omni.serving")


class _Server(uvicorn.Server):
    """uvicorn, exiting with status 0 after a graceful shutdown on SIGINT / SIGTERM.

    Plain uvicorn re-raises the signal once it has drained, which turns an
    orderly stop into exit status 130 (or death by SIGTERM). On the signal,
    calls still waiting for images answer 503 with Retry-After at once
    (``on_exit``), so the drain never has to cancel a handler mid-flight
    (which gave the client a plain-text 500 and the log a traceback).
    """

    def __init__(self, config: uvicorn.Config, on_exit=lambda: None):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            getattr(self, "_captured_signals", []).clear()


def serve_main(deployment, endpoint) -> int:
    """Serve ``deployment`` on ``endpoint`` (an ``omni.deployment.Endpoint``) until interrupted; 1 if the engine
    died."""
    sock = bind(endpoint)
    try:
        return _serve(deployment, endpoint, sock)
    finally:
        sock.close()


def bind(endpoint) -> socket.socket:
    """The server's socket, bound to ``endpoint`` (uvicorn listens on it later); a DeploymentError naming the
    address and the reason where it cannot be bound."""
    host = endpoint.host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
    try:
        sock.bind((host, endpoint.port))
    except OSError as e:
        sock.close()
        raise DeploymentError(f"cannot listen on {endpoint.host}:{endpoint.port} (--host/--port, serving.host/"
                              f"serving.port): {e.strerror or e}") from None
    return sock


def _serve(deployment, endpoint, sock: socket.socket) -> int:
    t0 = time.perf_counter()
    engine = deployment.open_engine(warm_up=True)  # world size > 1: launches the ranks and connects their replicas
    # From here on the engine is stopped whatever happens: a multi-rank engine's ranks ignore Ctrl-C (the
    # server stops them), so an exception or a Ctrl-C before uvicorn takes over the signals must stop them too.
    try:
        options = ServingOptions.from_recipe(deployment.recipe, model_id=deployment.model_id,
                                             api_key=endpoint.api_key)
        app = create_app(engine, options)
        server = _Server(uvicorn.Config(app, host=endpoint.host, port=endpoint.port, log_level="info",
                                        timeout_graceful_shutdown=5), on_exit=app.state.api.begin_shutdown)
        engine.start()

        def stop_if_dead(*_):
            if engine.status == "dead":
                server.should_exit = True
            elif engine.status == "ready":
                _log_ready(engine, time.perf_counter() - t0)

        _watch(engine, stop_if_dead)
        log.info("serving %s on http://%s:%d (platform %s, recipe %s); /health is 503 until the model is loaded",
                 options.model_id, endpoint.host, endpoint.port, deployment.recipe.platform, deployment.recipe.name)
        server.run(sockets=[sock])
    finally:
        engine.stop()
    if engine.status == "dead":
        log.error("the engine failed: %s: %s", type(engine.error).__name__, engine.error)
        return 1
    return 0


def _log_ready(engine: EngineHandle, seconds: float) -> None:
    """One line when the engine is ready: the seconds since the server started it, by part where it reports
    them (``omni_startup_seconds``: the build, the warm-up, its compile pass)."""
    from omni.scheduler_figures import startup_seconds

    detail = ", ".join(f"{part.replace('_', ' ')} {s:.1f} s" for part, s in startup_seconds(engine).items())
    log.info("ready in %.1f s%s", seconds, f" ({detail})" if detail else "")


def _watch(engine: EngineHandle, callback) -> None:
    """Call ``callback`` once the engine is ready or dead (from a helper thread)."""
    threading.Thread(target=lambda: (engine.wait_ready(), callback()), name="omni-engine-watch", daemon=True).start()
