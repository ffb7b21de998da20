"""Lock-step execution of a multi-rank replica under one scheduler.

The scheduler (``omni.scheduler``) runs on the replica's first rank and calls
a pipeline. ``DriverPipeline`` is that pipeline there: before each call that
runs model work (``admit``, ``prefill``, ``denoise_step``, ``release``) it
broadcasts the call over the replica's host-side control group (gloo), and
``follow`` on every other rank of the replica replays it on its own
pipeline, so all ranks enter the same forwards with the same requests in
the same order. Pure queries (``pages_needed``, ``build_rows``) stay local;
``decode`` (VAE) runs on the driver only, unless VAE tiling spreads the
tiles over the replica, in which case every rank decodes its tiles.

A request without a seed gets one on the driver before the broadcast, so
every rank draws the same noise.

Limitation: the scheduler's per-request retry after a failed packed step
assumes a single process; in a multi-rank replica an exception inside a
forward is raised again on the followers' side as a broken lock-step, so
the launcher tears the replica down instead (tests/parallel cover the
normal path only).
"""
from __future__ import annotations

import dataclasses
import random

STOP = "stop"


class DriverPipeline:
    """Wraps the driver rank's pipeline; every model call is mirrored on the followers first."""

    def __init__(self, pipeline, control):
        self.pipeline, self.control = pipeline, control
        self.pool = pipeline.pool

    def __getattr__(self, name):  # build_rows, step_tokens, cfg, ...: local and side-effect free
        return getattr(self.pipeline, name)

    def _send(self, op: str, payload=None) -> None:
        self.control.broadcast_object((op, payload), src=0)

    def pages_needed(self, req) -> int:
        return self.pipeline.pages_needed(req)

    def admit(self, req):
        if req.seed is None:
            req = dataclasses.replace(req, seed=random.randrange(2**31 - 1))
        self._send("admit", req)
        return self.pipeline.admit(req)

    def prefill(self, states) -> None:
        self._send("prefill", [s.request.request_id for s in states])
        self.pipeline.prefill(states)

    def denoise_step(self, states) -> None:
        self._send("denoise_step", [s.request.request_id for s in states])
        self.pipeline.denoise_step(states)

    def release(self, state) -> None:
        self._send("release", state.request.request_id)
        self.pipeline.release(state)

    def decode(self, state):
        if self.pipeline.vae_tiles is not None:  # tiles are spread over every rank of the replica
            self._send("decode", state.request.request_id)
        return self.pipeline.decode(state)

    def close(self) -> None:
        """Let the followers return from ``follow``."""
        self._send(STOP)


def follow(pipeline, control) -> int:
    """Replay the driver's calls on this rank until it closes; returns the number of calls replayed."""
    states: dict[str, object] = {}
    calls = 0
    while True:
        op, payload = control.broadcast_object(None, src=0)
        if op == STOP:
            return calls
        calls += 1
        if op == "admit":
            states[payload.request_id] = pipeline.admit(payload)
        elif op == "release":
            pipeline.release(states.pop(payload))
        elif op == "decode":
            pipeline.decode(states[payload])
        else:
            getattr(pipeline, op)([states[rid] for rid in payload])
