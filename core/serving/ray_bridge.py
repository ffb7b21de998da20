"""One HTTP request carried from the Ray Serve ingress to an engine replica, and its answer back.

The ingress (``ray_serve.Ingress``) reads a request into a ``Forwarded`` and
sends it to an engine replica through a streaming ``DeploymentHandle`` call.
On the replica, ``play`` runs it through the very app ``create_app`` built
over that replica's engine (same routes, validation, error bodies, metrics)
and yields: ``Accepted`` (which replica has it), then the answer, first a
``Head`` (status, headers, its scheduler figures) carrying the first body
chunk, then any further chunks (a streamed chat answer). A JSON answer is sent whole once the app has it,
so a replica that dies before its ``Head`` arrives has answered nothing and
the ingress may send the request again; a stream cut after its head is not
retried (its client already has part of it).

Imports no Ray: what crosses is plain picklable data.
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from omni.scheduler_figures import engine_figures

_DISCONNECT_GRACE_S = 5.0  # the app notices http.disconnect within its poll (0.2 s) and cancels its requests


@dataclass(frozen=True)
class Forwarded:
    """An HTTP request as the ingress received it (the body already read, within its limit)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None

    def scope(self) -> dict:
        """The ASGI http scope the replica's app receives."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query, "root_path": "", "headers": list(self.headers),
                "client": self.client, "server": None}


@dataclass(frozen=True)
class Accepted:
    """The first thing a replica sends: it has the request (the ingress counts it in flight there)."""

    replica: str


@dataclass(frozen=True)
class Head:
    """The start of a replica's answer: status, headers, the first body chunk, and who answered."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    more: bool  # further chunks follow (a streamed answer)
    replica: str
    stats: dict[str, float] = field(default_factory=dict)  # the replica's scheduler at answer time


def scheduler_stats(engine) -> dict[str, float]:
    """The figures of one replica's scheduler the ingress exports under that replica's label (a subset of the
    replica's own /metrics: ``scheduler_figures``). A multi-rank replica's scheduler runs in its first rank's
    process: its router asks it over the replica link (a round trip, so ``play`` reads this off the event loop);
    a rank that does not answer leaves only ``up``."""
    found = engine_figures(engine, memory=False)  # read at every answer: only what is exported
    if not found:
        return {"up": float(engine.ready)}
    figures = found[0][1]  # a Ray replica's ranks form one (dp 1)
    gauges, counters = figures["gauges"], figures["counters"]
    return {"up": float(engine.ready), "queue_depth": gauges["omni_queue_depth"],
            "running_requests": gauges["omni_running_requests"],
            "kv_pool_usage_ratio": gauges["omni_kv_pool_usage_ratio"],
            "finished": counters["finished"], "steps": counters["steps"]} | {
        f"startup_{part}_seconds": seconds for part, seconds in figures["startup"].items()}


async def play(app, request: Forwarded, replica: str, stats):
    """Run ``request`` through the ASGI ``app``; yield ``Accepted``, a ``Head``, then the remaining body chunks.

    ``stats()`` is read when the head is ready, in a thread (it may ask a rank over a link). If the caller stops
    listening (the ingress cancelled: its client left), the app sees
    ``http.disconnect`` and cancels the request's engine work itself.
    """
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    task = asyncio.create_task(app(request.scope(), _receiver(request.body, gone), messages.put))
    task.add_done_callback(lambda _t: messages.put_nowait(None))
    try:
        yield Accepted(replica)
        start = await _next(messages, "http.response.start")
        first = await _next(messages, "http.response.body")
        more = first.get("more_body", False)
        figures = await asyncio.to_thread(stats)
        yield Head(start["status"], tuple(start.get("headers", ())), first.get("body", b""), more, replica, figures)
        while more:
            message = await _next(messages, "http.response.body")
            more = message.get("more_body", False)
            yield message.get("body", b"")
    finally:
        gone.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), _DISCONNECT_GRACE_S)
        task.cancel()


def _receiver(body: bytes, gone: asyncio.Event):
    """ASGI ``receive``: the body once, then ``http.disconnect`` when the answer is over or abandoned."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


async def _next(messages: asyncio.Queue, kind: str) -> dict:
    message = await messages.get()
    if message is None:
        raise RuntimeError(f"the app ended without sending {kind}")
    if message["type"] != kind:
        raise RuntimeError(f"the app sent {message['type']} where {kind} was due")
    return message
