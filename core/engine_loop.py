"""The one thread that owns a pipeline: builds it, then steps its ``Scheduler`` while there is work.

Callers on other threads (the HTTP server, a replica's connection) submit and
cancel through it; every device call of the denoising steps happens on this
thread (a finished request's VAE decode may run on the scheduler's decode
thread meanwhile: ``omni.scheduler``). It implements ``omni.engine_handle.EngineHandle``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .request import ImageRequest
from .engine_handle import StepListener
from .scheduler import Scheduler
from .scheduler_errors import EngineUnavailable
from .scheduler_figures import scheduler_figures
from .ticket import Ticket

log = logging.getLogger("omni.engine_loop")


class EngineLoop:
    """The one thread that owns the pipeline: builds it, then steps the scheduler while there is work.

    ``build`` runs on the engine thread (so the pipeline's device work never
    touches the caller's thread) and returns the Scheduler. ``status`` is
    "starting", "ready", "dead" or "stopped"; ``error`` says why it died.
    """

    def __init__(self, build: Callable[[], Scheduler], *, name: str = "omni-engine"):
        self._build = build
        self._listeners: list[StepListener] = []
        self.scheduler: Scheduler | None = None
        self.status, self.error = "starting", None
        self._cv = threading.Condition()
        self._stop = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def around(cls, scheduler: Scheduler, **kw) -> "EngineLoop":
        """An engine loop over an already built scheduler."""
        return cls(lambda: scheduler, **kw)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.status == "ready"

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def stop(self, timeout: float | None = 30.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def observe_steps(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    def figures(self) -> dict:
        """The scheduler's ``scheduler_figures`` (for /metrics; a replica of a router answers the same over its
        link: ``RemoteReplica.figures``)."""
        if self.scheduler is None:
            raise EngineUnavailable(self.unavailable_reason())
        return scheduler_figures(self.scheduler)

    def load(self) -> int:
        sched = self.scheduler
        return 0 if sched is None else sched.queue_depth + sched.num_running

    def submit_many(self, reqs: list[ImageRequest]) -> list[Ticket]:
        if self.status != "ready":
            raise EngineUnavailable(self.unavailable_reason())
        tickets = self.scheduler.submit_many(reqs)
        with self._cv:
            self._cv.notify_all()
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        if self.scheduler is not None:
            self.scheduler.cancel(ticket)
        with self._cv:
            self._cv.notify_all()

    def unavailable_reason(self) -> str:
        if self.status == "starting":
            return "the model is still loading"
        if self.status == "dead":
            return f"the engine loop died: {type(self.error).__name__}: {self.error}"
        return "the engine is stopped"

    def _run(self) -> None:
        try:
            self.scheduler = self._build()
        except BaseException as e:
            self._die(e, "while building the pipeline")
            return
        self.status = "ready"
        self._ready.set()
        try:
            self._serve()
        except BaseException as e:
            self._die(e, "in the engine loop")
            return
        self.status = "stopped"
        self.scheduler.fail_all(EngineUnavailable("the engine is stopped"))
        self.scheduler.close()

    def _serve(self) -> None:
        sched = self.scheduler
        while True:
            with self._cv:
                while not self._stop and not sched.has_work():
                    self._cv.wait()
                if self._stop:
                    return
            t0 = time.perf_counter()
            finished = sched.step()
            for listener in self._listeners:
                listener(finished, time.perf_counter() - t0)
            if not sched.running and sched.waiting and not finished:
                with self._cv:  # nothing could be admitted (should not happen): do not spin
                    self._cv.wait(0.05)

    def _die(self, error: BaseException, where: str) -> None:
        self.status, self.error = "dead", error
        self._ready.set()
        log.critical("engine %s: %s: %s", where, type(error).__name__, error, exc_info=error)
        if self.scheduler is not None:
            self.scheduler.fail_all(EngineUnavailable(self.unavailable_reason()))
            self.scheduler.close()
