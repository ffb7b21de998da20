"""Data parallelism: independent replicas behind one server, and the router that feeds them.

A dp deployment is ``dp`` replicas of ``cfg*ulysses*ring*tp`` ranks each. A
replica serves on its first rank (an ``EngineLoop`` over a
``DriverPipeline``; its other ranks ``follow``). The server process holds a
``ReplicaRouter``, which looks like one ``EngineLoop`` to the HTTP app
(``submit_many``, ``cancel``, ``status``, ``ready``, ...) and sends every
submission to the least-loaded ready replica (outstanding requests;
round-robin among equals). The images of one HTTP request go to the same
replica, so ``submit_many`` stays all-or-nothing. A replica that reports
``QueueFull`` is skipped for the next least-loaded one.

Replicas in the server's process are plain ``EngineLoop``s; replicas in
other processes are ``RemoteReplica`` clients of ``serve_replica`` over a
``multiprocessing.connection`` (``replica_worker`` is the launcher target
that does all of it for a recipe).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import threading

from omni.request import ImageRequest
from omni.scheduler import EngineUnavailable, QueueFull, RequestCancelled, RequestTooLarge

_ERRORS = {c.__name__: c for c in (EngineUnavailable, RequestCancelled, RequestTooLarge)}
_STOP_WORKERS_S = 15.0  # a cancelled launch's SIGTERM grace (launch.TERMINATE_GRACE_S), with room to spare


def replica_load(replica) -> int:
    """Outstanding requests of a replica (waiting + running)."""
    if hasattr(replica, "load"):
        return replica.load()
    sched = getattr(replica, "scheduler", None)
    return 0 if sched is None else sched.queue_depth + sched.num_running


class ReplicaRouter:
    """Least-loaded routing over replicas; the ``EngineLoop`` surface the server uses."""

    def __init__(self, replicas: list):
        if not replicas:
            raise ValueError("ReplicaRouter needs at least one replica")
        self.replicas = list(replicas)
        self.scheduler = None  # per-replica scheduler metrics live with each replica
        self.on_step = None
        self._owner: dict[int, object] = {}
        self._turn = itertools.count()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "ReplicaRouter":
        for r in self.replicas:
            r.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        job = getattr(self, "job", None)  # the launch thread of start_replicas
        try:
            for r in self.replicas:
                r.stop(timeout)
            if job is not None:
                job.join(timeout)
        finally:
            # The launched ranks ignore SIGINT and are not daemons (multiprocessing joins them at exit): if the
            # orderly stop timed out or was itself interrupted, stop them here rather than leave them running.
            if job is not None and job.is_alive() and getattr(self, "cancel_job", None) is not None:
                self.cancel_job.set()
                job.join(_STOP_WORKERS_S)

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
        return next((r.error for r in self.replicas if getattr(r, "error", None) is not None), None)

    def unavailable_reason(self) -> str:
        return "; ".join(f"replica {i}: {r.unavailable_reason()}" for i, r in enumerate(self.replicas)
                         if not r.ready) or "ready"

    # ------------------------------------------------------------ requests
    def order(self) -> list:
        """Ready replicas, least loaded first (round-robin among equal loads)."""
        turn = next(self._turn)
        ready = [(replica_load(r), (i - turn) % len(self.replicas), r) for i, r in enumerate(self.replicas) if r.ready]
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


# ---------------------------------------------------------------------- replicas in other processes


class RemoteTicket:
    """A request submitted to a ``RemoteReplica``: ``future`` resolves when the replica answers."""

    def __init__(self, request: ImageRequest):
        self.request, self.future = request, concurrent.futures.Future()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def result(self, timeout: float | None = None):
        return self.future.result(timeout)


def _to_wire(e: BaseException) -> tuple:
    return type(e).__name__, str(e), getattr(e, "retry_after_s", None)


def _from_wire(name: str, message: str, retry_after) -> BaseException:
    if name == "QueueFull":
        return QueueFull(message, retry_after or 1)
    return _ERRORS.get(name, RuntimeError)(message if name in _ERRORS else f"{name}: {message}")


class RemoteReplica:
    """Client side of a replica served by ``serve_replica`` in another process (one connection)."""

    def __init__(self, conn, name: str = "replica"):
        self.conn, self.name = conn, name
        self.status, self.error = "starting", None
        self._ready = threading.Event()
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._tickets: dict[str, RemoteTicket] = {}
        self._acks: dict[int, concurrent.futures.Future] = {}
        self._calls = itertools.count()
        self._reader = threading.Thread(target=self._read, name=f"omni-{name}-reader", daemon=True)

    def start(self) -> "RemoteReplica":
        self._reader.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.ready

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def unavailable_reason(self) -> str:
        return {"starting": "the model is still loading"}.get(self.status, f"{self.status}: {self.error}")

    def load(self) -> int:
        with self._lock:
            return len(self._tickets)

    def submit_many(self, reqs: list[ImageRequest]) -> list[RemoteTicket]:
        if not self.ready:
            raise EngineUnavailable(self.unavailable_reason())
        tickets = [RemoteTicket(r) for r in reqs]
        with self._lock:
            self._tickets.update({t.request_id: t for t in tickets})
        try:
            self._call("submit", reqs)
        except BaseException:
            with self._lock:
                for t in tickets:
                    self._tickets.pop(t.request_id, None)
            raise
        return tickets

    def cancel(self, ticket) -> None:
        if self.ready:
            self._post(("cancel", None, ticket.request_id))

    def stop(self, timeout: float | None = 30.0) -> None:
        if self.status in ("ready", "starting"):
            try:
                self._post(("stop", None, None))
            except OSError:
                pass
        if self._reader.is_alive():  # never started when the server stops before it starts the router
            self._reader.join(timeout)

    def _post(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def _call(self, op: str, payload, timeout: float = 60.0):
        ack = concurrent.futures.Future()
        call = next(self._calls)
        with self._lock:
            self._acks[call] = ack
        self._post((op, call, payload))
        return ack.result(timeout)

    def _read(self) -> None:
        try:
            while True:
                kind, key, payload = self.conn.recv()
                if kind == "ready":
                    self.status = "ready"
                    self._ready.set()
                elif kind == "ack":
                    self._settle(self._acks, key, payload)
                elif kind == "done":
                    self._settle(self._tickets, key, payload)
                elif kind in ("stopped", "dead"):
                    self.status, self.error = kind, payload and _from_wire(*payload)
                    break
        except (EOFError, OSError) as e:
            self.status, self.error = "dead", e
        self._ready.set()
        self._fail_all(EngineUnavailable(f"{self.name} is {self.status}"))

    def _settle(self, table: dict, key, payload) -> None:
        with self._lock:
            item = table.pop(key, None)
        if item is None:
            return
        future = item if isinstance(item, concurrent.futures.Future) else item.future
        ok, value = payload
        if ok:
            future.set_result(value)
        else:
            future.set_exception(_from_wire(*value))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending = list(self._tickets.values()) + list(self._acks.values())
            self._tickets.clear()
            self._acks.clear()
        for item in pending:
            future = item if isinstance(item, concurrent.futures.Future) else item.future
            if not future.done():
                future.set_exception(error)


def serve_replica(engine, conn) -> None:
    """Serve ``engine`` (an ``EngineLoop``, started) to one ``RemoteReplica`` until it says stop."""
    lock = threading.Lock()
    tickets: dict[str, object] = {}

    def send(msg) -> None:
        with lock:
            try:
                conn.send(msg)
            except OSError:
                pass

    def finished(rid: str, future) -> None:
        tickets.pop(rid, None)
        error = future.exception()
        send(("done", rid, (True, future.result()) if error is None else (False, _to_wire(error))))

    if not engine.wait_ready():
        send(("dead", None, _to_wire(engine.error or RuntimeError("engine failed to start"))))
        return
    send(("ready", None, None))
    while True:
        try:
            op, call, payload = conn.recv()
        except (EOFError, OSError):
            break
        if op == "stop":
            break
        if op == "cancel":
            t = tickets.get(payload)
            if t is not None:
                engine.cancel(t)
            continue
        try:
            new = engine.submit_many(payload)
        except Exception as e:  # noqa: BLE001 - sent back to the router as the submission's error
            send(("ack", call, (False, _to_wire(e))))
            continue
        tickets.update({t.request_id: t for t in new})
        send(("ack", call, (True, None)))
        for t in new:
            t.future.add_done_callback(lambda f, rid=t.request_id: finished(rid, f))
    send(("stopped", None, None))


# ---------------------------------------------------------------------- one host: launch and connect


def start_replicas(recipe_ref: str, *, platform: str, model_path: str | None = None,
                   connect_timeout_s: float = 1800.0) -> ReplicaRouter:
    """Launch every rank of ``recipe_ref``'s mesh on this host and return the router over its dp replicas.

    The router is what ``omni.serving.app.create_app`` takes in place of an
    ``EngineLoop`` (call ``start()``, then ``wait_ready()``); ``stop()`` ends
    the replicas, and with them the launched workers. If the workers fail
    before every replica connected, the launch error is raised here.
    """
    import secrets
    from multiprocessing.connection import Listener

    from omni.recipe import load_recipe

    from .launch import launch
    from .mesh import Degrees

    degrees = Degrees.from_recipe(load_recipe(recipe_ref).parallel)
    authkey = secrets.token_bytes(32)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    failure: list[BaseException] = []
    cancel = threading.Event()

    def run() -> None:
        try:
            launch(replica_worker, degrees, platform=platform, cancel=cancel,
                   args=(listener.address, authkey, str(recipe_ref), model_path))
        except BaseException as e:  # noqa: BLE001 - reported by start_replicas or the replicas' status
            failure.append(e)
            listener.close()  # unblocks accept()

    job = threading.Thread(target=run, name="omni-replicas", daemon=True)
    timer = threading.Timer(connect_timeout_s, listener.close)
    replicas = []
    try:
        job.start()
        timer.start()
        for i in range(degrees.dp):
            replicas.append(RemoteReplica(listener.accept(), name=f"replica{i}"))
    except BaseException as e:
        # The launch failed (accept() unblocked), the timeout passed, or Ctrl-C came while the ranks load:
        # they ignore SIGINT, so stop them here; nothing else would before this process exits.
        reason = failure[0] if failure else f"timeout after {connect_timeout_s}s"  # before cancel adds its own
        cancel.set()
        if job.is_alive():
            job.join(_STOP_WORKERS_S)
        for r in replicas:
            r.conn.close()
        if not isinstance(e, OSError):
            raise
        raise RuntimeError(f"replicas of {recipe_ref} did not connect: {reason}") from None
    finally:
        timer.cancel()
    router = ReplicaRouter(replicas)
    router.job, router.cancel_job = job, cancel
    return router


# ---------------------------------------------------------------------- the launcher target


def replica_worker(ctx, address, authkey: bytes, recipe_ref: str, model_path: str | None = None) -> dict:
    """One rank of a dp deployment: build this replica's pipeline; serve it (first rank) or follow.

    ``address``/``authkey``: the ``multiprocessing.connection.Listener`` of the
    server process, which wraps each accepted connection in a ``RemoteReplica``.
    """
    from multiprocessing.connection import Client

    from omni.recipe import load_recipe
    from omni.engine_loop import EngineLoop
    from omni.scheduler import Scheduler
    from omni.models.hunyuan_image3.build import build_pipeline

    from .driver import DriverPipeline, follow
    from .runtime import ParallelRuntime

    recipe = load_recipe(recipe_ref)
    parallel = ParallelRuntime(ctx.mesh, ctx.platform) if ctx.degrees.replica_size > 1 else None
    pipeline = build_pipeline(recipe, ctx.platform, model_path=model_path, local_rank=ctx.info.local_rank,
                              progress=False, parallel=parallel)
    control = ctx.mesh.control("replica")
    if control.rank != 0:
        return {"rank": ctx.rank, "followed": follow(pipeline, control)}
    driver = DriverPipeline(pipeline, control)
    s = recipe.serving
    engine = EngineLoop(lambda: Scheduler(driver, max_running=s.max_running, max_queue=s.max_queue,
                                          max_batch_tokens=s.max_batch_tokens)).start()
    conn = Client(address, authkey=authkey)
    try:
        serve_replica(engine, conn)
    finally:
        engine.stop()
        driver.close()
        conn.close()
    return {"rank": ctx.rank, "replica": ctx.mesh.coords["dp"], "steps": engine.scheduler.stats["steps"]}
