"""How ``launch`` waits on its workers: their reports, their exits, the root cause of a failure, the stop.

Each worker sends one report on its pipe, ``(kind, rank, payload, traceback, unix time)``: ``"ok"`` with its
pickled result, ``"error"`` with a summary, or ``"interrupted"``. A worker that exits without a report (killed,
``os._exit``) is found by its process sentinel instead.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import pickle
import signal
import threading
import time
from typing import Any

TERMINATE_GRACE_S = 5.0
ROOT_CAUSE_WINDOW_S = 1.0
CANCEL_POLL_S = 0.1  # how often a launch with a cancel event looks at it


class LaunchCancelled(RuntimeError):
    """``launch``'s ``cancel`` event was set; every worker was stopped."""


class WorkerError(RuntimeError):
    """A worker failed; ``rank`` and the worker's own traceback are in the message."""

    def __init__(self, rank: int, summary: str, tb: str = "", silent: bool = False):
        self.rank, self.summary, self.worker_traceback = rank, summary, tb
        self.silent = silent  # it died without reporting (killed, os._exit): found by its exit, not a report
        super().__init__(f"rank {rank} failed: {summary}" + (f"\n--- rank {rank} traceback ---\n{tb}" if tb else ""))


def supervise(procs: list, reports: dict, timeout_s: float | None, cancel: threading.Event | None = None) -> list:
    """Collect results; on the first failure (error report or bad exit) stop everyone and raise.

    A failure makes its peers fail too (their collectives lose a member), so
    the failures arriving within ``ROOT_CAUSE_WINDOW_S`` are compared and the
    root cause wins (``_root_cause_order``), not an echo.
    """
    watch = _Watch(procs, reports, timeout_s, cancel)
    while len(watch.results) < len(procs):
        watch.check()
        for obj in mp.connection.wait(list(watch.waiting), timeout=watch.wait_s()):
            watch.take(obj)
    base_rank = min(reports.values())
    return [watch.results[base_rank + i] for i in range(len(procs))]


class _Watch:
    """What ``supervise`` knows between two waits: the results, the failures and what is still to wait on (each
    worker's report pipe and its process sentinel)."""

    def __init__(self, procs: list, reports: dict, timeout_s: float | None, cancel: threading.Event | None):
        self.reports, self.timeout_s, self.cancel = reports, timeout_s, cancel
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.results: dict[int, Any] = {}
        self.failures: list[tuple[float, WorkerError | KeyboardInterrupt]] = []
        self.by_sentinel = {p.sentinel: (p, reports[c]) for p, c in zip(procs, reports)}
        self.waiting = set(reports) | set(self.by_sentinel)
        self.settle_until: float | None = None  # the end of the root-cause window opened by the first failure

    def check(self) -> None:
        """Raise the root cause once the failures have settled, the timeout once it has passed, or the cancel."""
        now = time.monotonic()
        if self.failures and (self.settle_until is None or now >= self.settle_until or not self.waiting):
            raise min(self.failures, key=_root_cause_order)[1]
        if self.deadline is not None and now >= self.deadline:
            missing = sorted(set(self.reports.values()) - set(self.results))
            raise TimeoutError(f"workers {missing} did not finish within {self.timeout_s}s; all workers stopped")
        if self.cancel is not None and self.cancel.is_set():
            raise LaunchCancelled("launch cancelled; all workers stopped")

    def wait_s(self) -> float | None:
        """How long the next wait may block: to the deadline, to the end of the window, to the next look at the
        cancel event (an Event cannot join ``mp.connection.wait``); None: until something happens."""
        now = time.monotonic()
        limits = [t - now for t in (self.deadline, self.settle_until) if t is not None]
        if self.cancel is not None:
            limits.append(CANCEL_POLL_S)
        return max(0.0, min(limits)) if limits else None

    def take(self, obj) -> None:
        """A report arrived on ``obj`` or the worker of sentinel ``obj`` exited."""
        self.waiting.discard(obj)
        failure = _read_report(obj, self.results) if obj in self.reports else self._exited(*self.by_sentinel[obj])
        if failure is not None:
            self.failures.append(failure)
            self.settle_until = self.settle_until or time.monotonic() + ROOT_CAUSE_WINDOW_S

    def _exited(self, proc, rank: int):
        """A worker's exit is a failure of its own only when it left no report (those it sent are read first)."""
        proc.join()
        self._drain()
        reported = rank in self.results or any(getattr(f[1], "rank", None) == rank for f in self.failures)
        return None if reported else (time.time(), WorkerError(rank, _exit_reason(proc.exitcode), silent=True))

    def _drain(self) -> None:
        """Read reports already sent (a worker may exit before its report is read)."""
        for conn in [c for c in self.reports if c in self.waiting and c.poll()]:
            self.waiting.discard(conn)
            failure = _read_report(conn, self.results)
            if failure is not None:
                self.failures.append(failure)


def _root_cause_order(failure: tuple) -> tuple:
    """A rank that died without a word comes first: its peers' reports (a collective that lost a member)
    follow from it, yet its own time is only when the launcher noticed the exit, which under load can be
    after theirs. Otherwise the earliest report wins."""
    when, error = failure
    return (not getattr(error, "silent", False), when)


def _read_report(conn, results: dict):
    """Store a result, or return ``(time it failed, exception)``; None for a closed pipe."""
    try:
        kind, rank, payload, tb, when = conn.recv()
    except (EOFError, OSError):
        return None
    if kind == "ok":
        results[rank] = pickle.loads(payload)
        return None
    if kind == "interrupted":
        return when, KeyboardInterrupt(f"rank {rank} was interrupted")
    return when, WorkerError(rank, payload, tb)


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name} (for example out of memory)"
    if code == 70:
        return "exited because its launcher went away"
    return f"exited with code {code} without reporting a result"


def join_all(procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def stop_all(procs: list) -> None:
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    join_all(alive, TERMINATE_GRACE_S)
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
