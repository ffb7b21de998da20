"""``omni-run serve --ray``: a deployment's replicas as Ray Serve deployments, on one host or many.

    Ray HTTP proxy (every node, serving.host:port)
        -> Ingress (ray.ingress_replicas; CPU): reads the request, forwards it, retries it if its replica dies
        -> EngineReplica (ray.min_replicas .. ray.max_replicas): one engine each, the app of create_app over it

Each ``EngineReplica`` is one engine built from the frozen ``Deployment`` it
receives (``one_replica``: dp 1, world size / dp ranks, never a recipe name
to load again): world size 1 runs an ``EngineLoop`` in the replica's
process, more ranks are launched on the replica's host as ``serve`` launches
them. Ray places a replica where its devices are free
(``ray_actor_options.num_gpus``: devices per replica; 0 on the CPU). The
routes, their validation, error bodies and 429s are those of the replica's
own ``create_app``: the ingress relays bytes (``ray_bridge``) and adds
``X-Omni-Replica`` (the replica that answered).

No accepted request is lost to a replica that dies: a request whose replica
dies before its answer started is sent again (``ray.retries`` times) to a
live replica, while Ray Serve replaces the dead one. A request without a
``seed`` gets a new random seed on the retry, so a new image. Per replica:
Ray Serve's ``check_health`` is the engine's status; the ingress's
``/metrics`` labels answers, losses and each replica's scheduler figures
with the replica's id (Ray's own ``ray_serve_*`` metrics carry it too).

``omni-run serve --ray`` (``serve_ray_main``) is one way in; ``serve run
omni.serving.ray_serve:app recipe=NAME`` (``app``) is Ray's own.
"""
# No ``from __future__ import annotations`` here: Ray pickles these classes by value, and FastAPI must see the
# route parameters' real types (a string annotation would not resolve in the replica's process).
import asyncio
import logging
import threading
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from omni.deployment import Deployment, DeploymentError, Endpoint, one_replica

from .app import ServingOptions, create_app
from .endpoints import bearer_matches
from .ray_bridge import Forwarded, Head, play, scheduler_stats
from .ray_metrics import IngressMetrics

log = logging.getLogger("omni.serving.ray")

APP_NAME = "omni"
REPLICA_HEADER = "x-omni-replica"
MAX_FORWARD_BYTES = 256 << 20  # far above the app's own body limits (which answer 413 themselves)
LOST = (ActorDiedError, ActorUnavailableError, RayActorError)  # the replica went away mid-request
# content-length: the relayed response sets its own (or streams chunked); x-request-id: Ray's proxy sets it,
# to the id it gave the request, which the replica's app echoed
_NOT_RELAYED = (b"content-length", b"x-request-id")
RETRY_PAUSE_S = 0.2  # times the attempt number, before sending a request again


@dataclass(frozen=True)
class RayPlan:
    """What the Ray deployments are made of, decided once from the deployment and its ``ray`` section."""

    replica: Deployment  # one engine: dp 1
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: int
    devices_per_replica: int
    accelerator: bool
    max_ongoing_requests: int
    ingress_replicas: int
    retries: int

    @classmethod
    def of(cls, deployment: Deployment) -> "RayPlan":
        r = deployment.recipe
        lo = r.ray.min_replicas or r.parallel.dp
        hi = r.ray.max_replicas or lo
        if hi < lo:
            raise DeploymentError(f"recipe {r.name}: ray.max_replicas {hi} is below the replica floor {lo} "
                                  f"(ray.min_replicas, else parallel.dp {r.parallel.dp})")
        one = one_replica(deployment)
        return cls(one, lo, hi, r.ray.target_ongoing_requests or r.serving.max_running, one.world_size,
                   deployment.platform().info.accelerator, r.serving.max_running + r.serving.max_queue,
                   r.ray.ingress_replicas, r.ray.retries)

    def engine_options(self) -> dict:
        """``EngineReplica.options``: replica count (or autoscaling bounds), placement by devices."""
        opts = {"ray_actor_options": {"num_gpus": self.devices_per_replica if self.accelerator else 0},
                "max_ongoing_requests": self.max_ongoing_requests}
        if self.min_replicas == self.max_replicas:
            return opts | {"num_replicas": self.min_replicas}
        return opts | {"autoscaling_config": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                              "target_ongoing_requests": self.target_ongoing_requests}}


# ---------------------------------------------------------------------- the engine replicas


@serve.deployment(name="OmniEngine", health_check_period_s=5)
class EngineReplica:
    """One engine and the app of ``create_app`` over it; answers the ingress's forwarded requests."""

    async def __init__(self, deployment: Deployment, api_key: str | None = None):
        self.engine = deployment.open_engine(warm_up=True)  # world size > 1: launches the replica's ranks on this host
        self.engine.start()
        if not await asyncio.to_thread(self.engine.wait_ready):
            raise RuntimeError(f"the engine of {deployment.recipe.name} did not start: {self.engine.error}")
        options = ServingOptions.from_recipe(deployment.recipe, model_id=deployment.model_id, api_key=api_key)
        self.app = create_app(self.engine, options)
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def forward(self, request: Forwarded):
        """A ``Head``, then the rest of the body (``ray_bridge.play``)."""
        async for part in play(self.app, request, self.replica, lambda: scheduler_stats(self.engine)):
            yield part

    def check_health(self) -> None:
        """Ray Serve replaces this replica when its engine is no longer ready (died or stopped)."""
        if not self.engine.ready:
            raise RuntimeError(f"engine is {self.engine.status}: {self.engine.unavailable_reason()}")

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


# ---------------------------------------------------------------------- the ingress


@serve.deployment(name="OmniIngress", max_ongoing_requests=10_000)
@serve.ingress()
class Ingress:
    """Forwards every HTTP request to an engine replica; sends it again if that replica dies first."""

    def __init__(self, engines, retries: int, api_key: str | None = None):
        self.engines = engines.options(stream=True)
        self.retries, self.api_key = retries, api_key  # the key guards /metrics here as in the app
        self.metrics = IngressMetrics()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="omni-run (Ray Serve ingress)", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/metrics")
        async def metrics(request: Request):
            if not bearer_matches(request, self.api_key):
                return _error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "invalid_api_key",
                              kind="authentication_error")
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"])
        async def relay(request: Request, path: str):
            return await self.relay(request)

        return app

    async def relay(self, request: Request) -> Response:
        body = await _read_capped(request)
        if body is None:
            return _error(413, f"request body over {MAX_FORWARD_BYTES} bytes", "request_too_large")
        forwarded = Forwarded(request.method, _app_path(request), request.url.query.encode(),
                              tuple(request.headers.raw), body, request.client and tuple(request.client))
        try:
            sent = await self._send(forwarded)
        except RayTaskError as e:  # the bridge itself failed (the app answers its own errors)
            log.error("%s %s failed on its replica: %s", forwarded.method, forwarded.path, e)
            return _error(500, "the request failed on its replica (see the server log)", "internal_error")
        if sent is None:
            return _error(503, f"no replica answered after {self.retries + 1} attempts (each died first)",
                          "engine_unavailable")
        self.metrics.answered(sent[0])
        return _response(*sent)

    async def _send(self, forwarded: Forwarded) -> tuple[Head, object] | None:
        """(the head, the stream of the rest), trying live replicas until one answers; None if all died."""
        for attempt in range(self.retries + 1):
            await asyncio.sleep(RETRY_PAUSE_S * attempt)  # Ray's router drops a dead replica on its first error
            stream = self.engines.forward.remote(forwarded)
            try:
                return await self._head(stream), stream
            except asyncio.CancelledError:  # our client left: so does the replica's work
                stream.cancel()
                raise
            except LOST as e:
                self.metrics.lost.inc()
                log.warning("%s %s: its replica died before answering (%s); attempt %d of %d", forwarded.method,
                            forwarded.path, type(e).__name__, attempt + 1, self.retries + 1)
        self.metrics.failed.inc()
        return None

    async def _head(self, stream) -> Head:
        """The answer's head; until it comes, the request counts as in flight on the replica that took it."""
        accepted = await stream.__anext__()
        with self.metrics.in_flight.labels(accepted.replica).track_inprogress():
            return await stream.__anext__()


def _response(head: Head, stream) -> Response:
    """The replica's answer as the client gets it, with ``X-Omni-Replica``; a stream keeps streaming."""
    if head.more:
        response = StreamingResponse(_rest(head.body, stream), status_code=head.status)
    else:
        response = Response(head.body, status_code=head.status)
    for k, v in head.headers:
        if k.lower() not in _NOT_RELAYED:
            response.headers.append(k.decode("latin-1"), v.decode("latin-1"))
    response.headers[REPLICA_HEADER] = head.replica
    return response


async def _rest(first: bytes, stream):
    """A streamed answer's chunks; if our client leaves mid-stream, the replica stops too."""
    try:
        yield first
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()


def _app_path(request: Request) -> str:
    """The path below the application's route prefix (``serve run`` may mount it under one)."""
    path, root = request.url.path, request.scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


async def _read_capped(request: Request) -> bytes | None:
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORWARD_BYTES:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _error(status: int, message: str, code: str, kind: str = "server_error") -> JSONResponse:
    """An OpenAI-shaped error body, as the app's own."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status)


# ---------------------------------------------------------------------- building and running


def build_app(deployment: Deployment, api_key: str | None = None):
    """The Ray Serve application for ``deployment`` (bound, not yet running)."""
    plan = RayPlan.of(deployment)
    engines = EngineReplica.options(**plan.engine_options()).bind(plan.replica, api_key)
    return Ingress.options(num_replicas=plan.ingress_replicas).bind(engines, plan.retries, api_key)


def app(args: dict):
    """``serve run omni.serving.ray_serve:app recipe=NAME [platform=..] [model=PATH]``: Ray's own CLI."""
    from omni.deployment import prepare

    unknown = sorted(set(args) - {"recipe", "platform", "model"})
    if unknown:
        raise DeploymentError(f"serve run omni.serving.ray_serve:app: unknown argument(s) {', '.join(unknown)}; "
                              "allowed: recipe, platform, model")
    overrides = {"model.path": args["model"]} if args.get("model") else {}
    return build_app(prepare(args.get("recipe", "cpu_tiny"), platform=args.get("platform"), overrides=overrides))


def serve_ray_main(deployment: Deployment, endpoint: Endpoint, address: str | None = None) -> int:
    """Run ``deployment`` on the Ray cluster at ``address`` (None: a new local one) until interrupted."""
    import ray

    ray.init(address=address, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": endpoint.host, "port": endpoint.port})
        serve.run(build_app(deployment, endpoint.api_key), name=APP_NAME, route_prefix="/")
        log.info("serving %s through Ray Serve on http://%s:%d (recipe %s); Ctrl-C stops it", deployment.model_id,
                 endpoint.host, endpoint.port, deployment.recipe.name)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
        ray.shutdown()
    return 0
