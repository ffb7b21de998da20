"""One submitted request as the scheduler tracks it: its future, its cost, its timestamps.

``snapshot_state`` / ``restore_state`` copy a pipeline state's attributes so a failed packed step can be
retried one request at a time from where each request stood.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from dataclasses import dataclass

from .request import ImageRequest, ImageResult


@dataclass(frozen=True)
class Cost:
    pages: int  # KV pages for all of the request's rows, allocated together
    step_tokens: int  # packed tokens one denoising step of this request adds


class Ticket:
    """One submitted request: its future, cost, timestamps and (while running) pipeline state."""

    def __init__(self, request: ImageRequest, cost: Cost, now: float):
        self.request, self.cost = request, cost
        self.future: concurrent.futures.Future[ImageResult] = concurrent.futures.Future()
        self.submitted_at, self.admitted_at, self.finished_at = now, None, None
        self.state = None
        self.released = False  # pages given back (guards against a double release)
        self._cancelled = threading.Event()
        # a text request's answer so far, put after every step that changed it (streams read it)
        self.updates: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._published = ""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def result(self, timeout: float | None = None) -> ImageResult:
        return self.future.result(timeout)

    def mark_cancelled(self) -> None:
        """Ask for this request to end (any thread); the scheduler acts on it at its next step boundary."""
        self._cancelled.set()

    def publish(self, text: str) -> None:
        """Put a text request's answer so far on ``updates`` if it changed since the last one."""
        if text != self._published:
            self._published = text
            self.updates.put(text)


def settle(future: concurrent.futures.Future, *, result=None, error: BaseException | None = None) -> None:
    """Resolve ``future`` unless it already is (a waiter may have cancelled it from its side)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def snapshot_state(state) -> dict:
    return dict(vars(state))


def restore_state(state, saved: dict) -> None:
    vars(state).clear()
    vars(state).update(saved)
