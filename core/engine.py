"""Synchronous engine: run a list of requests to completion in the calling thread.

A thin driver over ``Scheduler`` (core/scheduler.py holds the policy: FIFO
admission under the KV pool and the activation budget, one packed denoising
step per iteration, requests joining and leaving at step boundaries). The
server runs the same scheduler on its own thread (``omni.engine_loop.EngineLoop``); this class
is for ``omni-run generate``, benchmarks and tests.
"""
from __future__ import annotations

from typing import Callable, Iterable

from .request import ImageRequest, ImageResult
from .scheduler import Scheduler
from .ticket import Ticket


class Engine:
    def __init__(self, pipeline, max_running: int = 8, max_batch_tokens: int | None = None,
                 pack_prefill: bool = False):
        self.pipeline = pipeline
        self.scheduler = Scheduler(pipeline, max_running=max_running, max_batch_tokens=max_batch_tokens,
                                   pack_prefill=pack_prefill)

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self):
        return self.scheduler.running

    def submit(self, req: ImageRequest) -> Ticket:
        """Queue ``req``; raises RequestTooLarge at once if it can never fit in the KV pool."""
        return self.scheduler.submit(req)

    def iterate(self) -> list[ImageResult]:
        """One engine iteration; results of the requests that finished in it (a failure raises)."""
        return [t.future.result() for t in self.scheduler.step()]

    def run(self, requests: Iterable[ImageRequest],
            progress: Callable[[list[ImageResult], "Engine"], None] | None = None) -> list[ImageResult]:
        """Run ``requests`` to completion; results in completion order. The first failure raises."""
        tickets = [self.submit(r) for r in requests]
        results: list[ImageResult] = []
        while self.scheduler.has_work():
            results += self.iterate()
            if progress is not None:
                progress(results, self)
        assert all(t.future.done() for t in tickets)
        return results
