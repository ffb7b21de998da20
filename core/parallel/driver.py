"""Lock-step execution of a multi-rank replica under one scheduler.

The scheduler (``omni.scheduler``) runs on the replica's first rank and calls
a pipeline. ``DriverPipeline`` is that pipeline there: before each call that
runs model work (``admit``, ``prefill``, ``denoise_step``, ``release``) it
broadcasts the call over the replica's host-side control group (gloo), and
``follow`` on every other rank of the replica replays it on its own
pipeline, so all ranks enter the same forwards with the same requests in
the same order. Pure queries (``pages_needed``, ``step_tokens``) stay local;
``decode`` (VAE) runs on the driver only, unless VAE tiling spreads the
tiles over the replica, in which case every rank decodes its tiles. A
warm-up's compile pass (``compile_pass``) is entered and left on every rank.

A request without a seed gets one on the driver before the broadcast, so
every rank draws the same noise.

Failures: after every mirrored call the replica's ranks agree on its
outcome (one host-side all-gather). When the call failed on every rank (a
request-specific error: bad input, an allocation past the budget) the driver
raises it and the scheduler isolates it as in one process (retry one request
at a time, fail only the bad one); the followers restore the states a failed
step touched, as the scheduler does on the driver, and go on following. When
it failed on some ranks only, their states differ and lock-step cannot be
restored: every rank raises ``LockStepLost``, which per-request isolation
does not catch, so the replica goes down with the failing ranks named. (A
forward that fails on some ranks only, before one of its collectives, leaves
the others waiting in that collective: the distributed timeout of the
launcher ends the job then.)

Memory: the outcome gather of ``admit`` and ``release`` also carries each
rank's device memory (``memory_stats``), so the driver can report every
rank's figures (``DriverPipeline.memory_by_rank``, for /metrics) without a
collective of its own; steps never pay for the reads.
"""
from __future__ import annotations

import dataclasses
import random
from contextlib import ExitStack, contextmanager

from omni.ticket import restore_state, snapshot_state

STOP = "stop"
COMPILE_PASS = "compile_pass"  # payload True: enter this rank's compile pass; False: leave it
MEMORY_OPS = ("admit", "release")  # once per request each: the gathers that carry every rank's memory


class LockStepLost(BaseException):
    """A mirrored call failed on some ranks of a replica only: their states differ for good.

    A BaseException on purpose: the scheduler's per-request isolation catches
    ``Exception``; this must end the engine loop instead (the replica is dead).
    """


def agree(control, op: str, error: BaseException | None, memory: dict | None = None) -> list:
    """All ranks learn every rank's outcome of ``op``; raises ``LockStepLost`` when they differ. Returns every
    rank's ``memory`` (what each passed: ``rank_memory`` for ``MEMORY_OPS``, else None), in rank order."""
    gathered = control.all_gather_object((None if error is None else f"{type(error).__name__}: {error}", memory))
    outcomes = [outcome for outcome, _ in gathered]
    failed = [r for r, o in enumerate(outcomes) if o is not None]
    if failed and len(failed) < len(outcomes):
        raise LockStepLost(f"{op} failed on replica rank(s) {failed} only ({outcomes[failed[0]]}); "
                           "the ranks no longer hold the same state") from error
    return [m for _, m in gathered]


def rank_memory(pipeline, op: str) -> dict | None:
    """This rank's device memory in bytes by name when ``op`` carries it (``MEMORY_OPS``), else None."""
    return _memory(pipeline) if op in MEMORY_OPS else None


def _memory(pipeline) -> dict:
    return dict(getattr(pipeline, "memory_stats", dict)())


def _outcome(fn):
    """``(result, None)`` or ``(None, the exception)`` of ``fn()``."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 -- every rank reports it; agree() decides
        return None, e


class DriverPipeline:
    """Wraps the driver rank's pipeline; every model call is mirrored on the followers first."""

    def __init__(self, pipeline, control):
        self.pipeline, self.control = pipeline, control
        self.pool = pipeline.pool
        self.followers_memory: list[dict] = []  # ranks 1.. as of the last admit or release

    def __getattr__(self, name):  # step_tokens, concurrent_decode, ...: local and side-effect free
        return getattr(self.pipeline, name)

    def _send(self, op: str, payload=None) -> None:
        self.control.broadcast_object((op, payload), src=0)

    def _mirrored(self, op: str, payload, fn):
        """Broadcast ``op``, run it here, agree on the outcome with the followers; raise a shared failure."""
        self._send(op, payload)
        result, error = _outcome(fn)
        memory = agree(self.control, op, error, rank_memory(self.pipeline, op))
        if op in MEMORY_OPS:
            self.followers_memory = memory[1:]
        if error is not None:
            raise error
        return result

    def memory_by_rank(self) -> list[dict]:
        """Each rank's device memory in bytes by name, in rank order: this rank's read now, the others' as of the
        replica's last admit or release (only this rank's before the first request)."""
        return [_memory(self.pipeline)] + self.followers_memory

    def pages_needed(self, req) -> int:
        return self.pipeline.pages_needed(req)

    def admit(self, req):
        if req.seed is None:
            req = dataclasses.replace(req, seed=random.randrange(2**31 - 1))
        return self._mirrored("admit", req, lambda: self.pipeline.admit(req))

    def prefill(self, states) -> None:
        self._mirrored("prefill", _ids(states), lambda: self.pipeline.prefill(states))

    def denoise_step(self, states) -> None:
        self._mirrored("denoise_step", _ids(states), lambda: self.pipeline.denoise_step(states))

    def release(self, state) -> None:
        self._mirrored("release", state.request.request_id, lambda: self.pipeline.release(state))

    def decode(self, state):
        if self.pipeline.vae_tiles is not None:  # tiles are spread over every rank of the replica
            return self._mirrored("decode", state.request.request_id, lambda: self.pipeline.decode(state))
        return self.pipeline.decode(state)

    def compile_pass(self):
        """The warm-up's compile pass (``omni.compile_pass``) on every rank of the replica: the followers enter
        theirs when it is entered here and leave it when it is left, so every rank's kernels compile, not run,
        in the same calls. None where this rank's platform has no compile scope (nor, then, the others')."""
        local = self.pipeline.compile_pass()
        return None if local is None else self._pass_everywhere(local)

    @contextmanager
    def _pass_everywhere(self, local):
        self._mirrored(COMPILE_PASS, True, local.__enter__)
        try:
            yield
        finally:  # leaving waits for the compiles and raises the first compile error, on every rank
            self._mirrored(COMPILE_PASS, False, lambda: local.__exit__(None, None, None))

    def close(self) -> None:
        """Let the followers return from ``follow``."""
        self._send(STOP)


def _ids(states) -> list[str]:
    return [s.request.request_id for s in states]


def follow(pipeline, control) -> int:
    """Replay the driver's calls on this rank until it closes; returns the number of calls replayed."""
    states: dict[str, object] = {}
    calls = 0
    with ExitStack() as passes:  # the compile pass this rank is in, entered and left on the driver's word
        while True:
            op, payload = control.broadcast_object(None, src=0)
            if op == STOP:
                return calls
            calls += 1
            _, error = _outcome(lambda: _replay(pipeline, states, op, payload, passes))
            agree(control, op, error, rank_memory(pipeline, op))  # failed on every rank: the driver isolates it


def _replay(pipeline, states: dict, op: str, payload, passes: ExitStack) -> None:
    if op == COMPILE_PASS:
        _enter_or_leave(pipeline, payload, passes)
    elif op == "admit":
        states[payload.request_id] = pipeline.admit(payload)
    elif op == "release":
        pipeline.release(states.pop(payload))
    elif op == "decode":
        pipeline.decode(states[payload])
    else:
        rows = [states[rid] for rid in payload]
        saved = [snapshot_state(s) for s in rows]
        try:
            getattr(pipeline, op)(rows)
        except Exception:
            for s, before in zip(rows, saved):  # as the driver's scheduler restores its own
                restore_state(s, before)
            raise


def _enter_or_leave(pipeline, enter: bool, passes: ExitStack) -> None:
    """The driver's ``COMPILE_PASS`` word on a follower: enter this rank's compile pass, or leave it (waits for
    its compiles)."""
    scope = pipeline.compile_pass() if enter else None
    if scope is not None:
        passes.enter_context(scope)
    elif not enter:
        passes.close()
