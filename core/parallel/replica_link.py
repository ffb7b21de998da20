"""A replica in other processes, seen from the server: ``RemoteReplica`` and its far end ``serve_replica``.

One ``multiprocessing.connection`` per replica carries tuples ``(kind, key,
payload)``: the client sends submit / cancel / stats / stop, the replica's
first rank answers ready, ack, done, stopped or dead (``stats`` is acked with
the replica's ``scheduler_figures``, for the server's /metrics). Errors cross as
``(type name, message, retry_after)`` and are rebuilt as the scheduler's own
exception types, so the HTTP layer maps them exactly as for a local engine.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import threading

from omni.request import ImageRequest
from omni.scheduler_errors import EngineUnavailable, QueueFull, RequestCancelled, RequestTooLarge

FIGURES_TIMEOUT_S = 5.0  # a /metrics scrape waits this long for a replica's figures, then leaves them out
_ERRORS = {c.__name__: c for c in (EngineUnavailable, RequestCancelled, RequestTooLarge)}


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
        self.warm_up_s: float | None = None  # what the replica's warm-up took, as its ready message says
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

    scheduler = None  # the replica's scheduler lives in its own process

    def load(self) -> int:
        with self._lock:
            return len(self._tickets)

    def observe_steps(self, listener) -> None:
        """Steps run in the replica's process: nothing to observe here."""

    def figures(self) -> dict:
        """The replica's ``scheduler_figures``, asked over the link (for /metrics)."""
        return self._call("stats", None, timeout=FIGURES_TIMEOUT_S)

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
                    self.warm_up_s = (payload or {}).get("warm_up_s")
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
    _ReplicaServer(engine, conn).run()


def report_dead(conn, error: BaseException) -> None:
    """Tell the ``RemoteReplica`` at the other end that this replica will not serve, and why (a failed load)."""
    try:
        conn.send(("dead", None, _to_wire(error)))
    except OSError:
        pass


class _ReplicaServer:
    """The replica's end of the link: submissions and cancels in, acks and results out (results are sent from
    the engine's threads as the futures settle, so sends share a lock)."""

    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self.lock = threading.Lock()
        self.tickets: dict[str, object] = {}

    def run(self) -> None:
        if not self.engine.wait_ready():
            report_dead(self.conn, self.engine.error or RuntimeError("engine failed to start"))
            return
        self.send(("ready", None, {"warm_up_s": self.engine.scheduler.warm_up_s}))
        while True:
            try:
                op, call, payload = self.conn.recv()
            except (EOFError, OSError):
                break
            if op == "stop":
                break
            if op == "cancel":
                self.cancel(payload)
            elif op == "stats":
                self.stats(call)
            else:
                self.submit(call, payload)
        self.send(("stopped", None, None))

    def send(self, msg) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except OSError:
                pass

    def cancel(self, request_id: str) -> None:
        ticket = self.tickets.get(request_id)
        if ticket is not None:
            self.engine.cancel(ticket)

    def stats(self, call) -> None:
        try:
            self.send(("ack", call, (True, self.engine.figures())))
        except Exception as e:  # noqa: BLE001 - the router's scrape leaves this replica out
            self.send(("ack", call, (False, _to_wire(e))))

    def submit(self, call, requests) -> None:
        try:
            new = self.engine.submit_many(requests)
        except Exception as e:  # noqa: BLE001 - sent back to the router as the submission's error
            self.send(("ack", call, (False, _to_wire(e))))
            return
        self.tickets.update({t.request_id: t for t in new})
        self.send(("ack", call, (True, None)))
        for t in new:
            t.future.add_done_callback(lambda f, rid=t.request_id: self.finished(rid, f))

    def finished(self, request_id: str, future) -> None:
        self.tickets.pop(request_id, None)
        error = future.exception()
        self.send(("done", request_id, (True, future.result()) if error is None else (False, _to_wire(error))))
