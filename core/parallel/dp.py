"""Data parallelism: independent replicas behind one server, and the router that feeds them.

A dp deployment is ``dp`` replicas of ``cfg*ulysses*ring*tp`` ranks each. A
replica serves on its first rank (an ``EngineLoop`` over a
``DriverPipeline``; its other ranks ``follow``). The server process holds a
``ReplicaRouter``, which looks like one ``EngineLoop`` to the HTTP app
(``submit_many``, ``cancel``, ``status``, ``ready``, ...) and sends every
submission to the least-loaded ready replica (outstanding requests;
round-robin among equals). The images of one HTTP request go to the same
replica, so ``submit_many`` stays all-or-nothing. A replica that reports
``QueueFull`` is skipped for the next least-loaded one. Router, remote
replicas and engine loops all implement ``omni.engine_handle.EngineHandle``.

Replicas in the server's process are plain ``EngineLoop``s; replicas in
other processes are ``RemoteReplica`` clients of ``serve_replica`` over a
``multiprocessing.connection`` (replica_link.py; ``replica_worker`` is the
launcher target that does all of it for a deployment).

This router is the single-host fast path: every rank on this host, links on
127.0.0.1, no Ray needed. Replicas across hosts are Ray Serve deployments
(``omni-run serve --ray``, ``omni.serving.ray_serve``); each Ray replica that
has more than one rank launches them with ``start_replicas`` (dp 1) as here.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from omni.request import ImageRequest
from omni.scheduler_errors import EngineUnavailable, QueueFull

from .replica_link import RemoteReplica, report_dead, serve_replica
from .replica_listener import ConnectAbandoned, ReplicaListener

log = logging.getLogger("omni.parallel")
_STOP_WORKERS_S = 15.0  # a cancelled launch's SIGTERM grace (supervise.TERMINATE_GRACE_S), with room to spare


@dataclass(frozen=True)
class LaunchJob:
    """The thread running ``launch`` for a router's replicas, the event that cancels it, and the launch's error
    once it failed (a rank's ``WorkerError``: the root cause when a replica's link then drops)."""

    thread: threading.Thread
    cancel: threading.Event
    failures: list

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None) -> None:
        self.thread.join(timeout)


class ReplicaRouter:
    """Least-loaded routing over replicas (``EngineHandle``s); itself an ``EngineHandle``.

    ``job``: the launch of the replicas' ranks when the router started them
    (``start_replicas``); ``stop()`` ends them with the replicas.
    """

    scheduler = None  # each replica has its own: /metrics asks them (replica_figures)

    def __init__(self, replicas: list, job: LaunchJob | None = None):
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one replica")
        self.replicas, self.job = list(replicas), job
        self._owner: dict[int, object] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "ReplicaRouter":
        for r in self.replicas:
            r.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        job = self.job
        try:
            for r in self.replicas:
                r.stop(timeout)
            if job is not None:
                job.join(timeout)
        finally:
            # The launched ranks ignore SIGINT and are not daemons (multiprocessing joins them at exit): if the
            # orderly stop timed out or was itself interrupted, stop them here rather than leave them running.
            if job is not None and job.is_alive():
                job.cancel.set()
                job.join(_STOP_WORKERS_S)

    def observe_steps(self, listener) -> None:
        for r in self.replicas:
            r.observe_steps(listener)

    def replica_figures(self) -> list[tuple[int, dict]]:
        """(index, ``scheduler_figures``) of each ready replica, for /metrics; one that does not answer is left
        out of this scrape (a scrape never fails for it). The replicas are asked at once, so one slow to answer
        (its link's limit) delays the scrape by its own limit, not by one per replica."""
        ready = [(i, r) for i, r in enumerate(self.replicas) if r.ready]
        if not ready:
            return []
        with ThreadPoolExecutor(len(ready), thread_name_prefix="omni-figures") as pool:
            asked = [(i, pool.submit(r.figures)) for i, r in ready]
        out = []
        for i, answer in asked:
            try:
                out.append((i, answer.result()))
            except Exception as e:  # noqa: BLE001 - a replica stopping or slow to answer: its figures are missing
                log.debug("replica %d gave no figures: %r", i, e)
        return out

    def load(self) -> int:
        return sum(r.load() for r in self.replicas)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return any([r.wait_ready(timeout) for r in self.replicas])

    @property
    def ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    @property
    def status(self) -> str:
        states = [r.status for r in self.replicas]
        for s in ("ready", "starting"):
            if s in states:
                return s
        return "dead" if "dead" in states else "stopped"

    @property
    def error(self):
        if self.job is not None and self.job.failures:  # a rank failed: its replica's link only saw the hang-up
            return self.job.failures[0]
        return next((r.error for r in self.replicas if getattr(r, "error", None) is not None), None)

    def unavailable_reason(self) -> str:
        return "; ".join(f"replica {i}: {r.unavailable_reason()}" for i, r in enumerate(self.replicas)
                         if not r.ready) or "ready"

    # ------------------------------------------------------------ requests
    def order(self) -> list:
        """Ready replicas, least loaded first (round-robin among equal loads)."""
        turn = next(self._turn)
        ready = [(r.load(), (i - turn) % len(self.replicas), r) for i, r in enumerate(self.replicas) if r.ready]
        return [r for _, _, r in sorted(ready, key=lambda x: x[:2])]

    def submit_many(self, reqs: list[ImageRequest]) -> list:
        candidates = self.order()
        if not candidates:
            raise EngineUnavailable(self.unavailable_reason())
        full = None
        for replica in candidates:
            try:
                tickets = replica.submit_many(reqs)
            except QueueFull as e:
                full = e
                continue
            with self._lock:
                for t in tickets:
                    self._owner[id(t)] = replica
                    t.future.add_done_callback(lambda _f, key=id(t): self._forget(key))
            return tickets
        raise full

    def cancel(self, ticket) -> None:
        with self._lock:
            owner = self._owner.get(id(ticket))
        if owner is not None:
            owner.cancel(ticket)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._owner.pop(key, None)


# ---------------------------------------------------------------------- one host: launch and connect


def start_replicas(deployment, *, connect_timeout_s: float = 1800.0, warm_up: bool = False,
                   compile_ahead: tuple = ()) -> ReplicaRouter:
    """Launch every rank of ``deployment``'s mesh on this host and return the router over its dp replicas.

    Every rank receives the ``Deployment`` itself (the checked, patched
    recipe), never a name to load again. The router is an ``EngineHandle``
    like a local engine loop (call ``start()``, then ``wait_ready()``);
    ``stop()`` ends the replicas, and with them the launched workers. If the
    workers fail before every replica connected, the launch error is raised
    here; past ``connect_timeout_s`` the launch is stopped and a timeout raised. ``warm_up`` and
    ``compile_ahead``: what each replica runs before it reports ready (``omni.engine_handle.open_engine``).
    """
    import secrets

    from .mesh import Degrees

    degrees = Degrees.from_recipe(deployment.recipe.parallel)
    listener = ReplicaListener(secrets.token_bytes(32))
    job = _launch_job(deployment, degrees, listener, warm_up, compile_ahead)
    deadline = time.monotonic() + connect_timeout_s

    def give_up() -> str | None:
        if job.failures:
            return str(job.failures[0])
        return f"timeout after {connect_timeout_s}s" if time.monotonic() >= deadline else None

    replicas = []
    try:
        job.thread.start()
        for i in range(degrees.dp):
            replicas.append(RemoteReplica(listener.accept(give_up), name=f"replica{i}"))
    except BaseException as e:
        # The launch failed, the timeout passed, a rank hung up mid-handshake, or Ctrl-C came while the ranks
        # load: they ignore SIGINT, so stop them here; nothing else would before this process exits.
        _abandon(job, replicas)
        if isinstance(e, (ConnectAbandoned, OSError, EOFError)):
            reason = e if isinstance(e, ConnectAbandoned) else (job.failures[0] if job.failures else repr(e))
            raise RuntimeError(f"replicas of {deployment.recipe.name} did not connect: {reason}") from None
        raise
    finally:
        listener.close()
    return ReplicaRouter(replicas, job)


def _launch_job(deployment, degrees, listener: ReplicaListener, warm_up: bool, compile_ahead: tuple) -> LaunchJob:
    """The launch of every rank, its thread not yet started; its error lands in ``failures`` (which
    ``start_replicas``' wait for connections looks at)."""
    from .launch import launch

    failure: list[BaseException] = []
    cancel = threading.Event()

    def run() -> None:
        try:
            launch(replica_worker, degrees, platform=deployment.recipe.platform, cancel=cancel,
                   args=(listener.address, listener.authkey, deployment, warm_up, compile_ahead))
        except BaseException as e:  # noqa: BLE001 - reported by start_replicas or the replicas' status
            failure.append(e)

    return LaunchJob(threading.Thread(target=run, name="omni-replicas", daemon=True), cancel, failure)


def _abandon(job: LaunchJob, replicas: list) -> None:
    """Stop a launch that will not be served: cancel its ranks, wait for them, close the links made so far."""
    job.cancel.set()
    if job.is_alive():
        job.join(_STOP_WORKERS_S)
    for r in replicas:
        r.conn.close()


# ---------------------------------------------------------------------- the launcher target


def replica_worker(ctx, address, authkey: bytes, deployment, warm_up: bool = False,
                   compile_ahead: tuple = ()) -> dict:
    """One rank of a deployment: build this replica's pipeline; serve it (first rank) or follow.

    ``address``/``authkey``: the server process's ``ReplicaListener`` (a
    ``multiprocessing.connection`` handshake), which wraps each accepted
    connection in a ``RemoteReplica``.
    """
    from multiprocessing.connection import Client

    from omni.engine_loop import EngineLoop
    from omni.engine_handle import serving_scheduler, warm_up_requests

    from .driver import DriverPipeline, follow
    from .runtime import ParallelRuntime

    parallel = ParallelRuntime(ctx.mesh, ctx.platform) if ctx.degrees.replica_size > 1 else None
    control = ctx.mesh.control("replica")
    # The first rank connects before it loads: the server serves (GET /health: 503, "starting") while the
    # replicas load, and a load that fails reaches it with its reason, not as a dropped link.
    conn = Client(address, authkey=authkey) if control.rank == 0 else None
    t0 = time.perf_counter()
    try:
        pipeline = deployment.build_pipeline(platform=ctx.platform, local_rank=ctx.info.local_device,
                                             progress=False, parallel=parallel)
    except BaseException as e:
        if conn is not None:
            report_dead(conn, e)
        raise
    if conn is None:
        return {"rank": ctx.rank, "followed": follow(pipeline, control)}
    driver = DriverPipeline(pipeline, control)
    warm = warm_up_requests(deployment) if warm_up else ()
    build_s = time.perf_counter() - t0
    engine = EngineLoop(lambda: serving_scheduler(driver, deployment.recipe, warm, build_s=build_s,
                                                  compile_ahead=compile_ahead)).start()
    try:
        serve_replica(engine, conn)
    finally:
        engine.stop()
        driver.close()
        conn.close()
    return {"rank": ctx.rank, "replica": ctx.mesh.coords["dp"], "steps": engine.scheduler.stats["steps"]}
