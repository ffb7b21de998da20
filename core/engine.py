"""Step-level engine loop: admit, prefill, one denoising step for all, finish.

The engine owns no model knowledge; it drives a pipeline with ``admit``,
``prefill``, ``denoise_step``, ``decode`` and ``release``. Requests join and
leave only at step boundaries, so different resolutions, step counts and
guidance scales share every forward.
"""
from __future__ import annotations

import time
from typing import Iterable

from .request import ImageRequest, ImageResult


class Engine:
    def __init__(self, pipeline, max_running: int = 8):
        self.pipeline, self.max_running = pipeline, max_running
        self.waiting: list[ImageRequest] = []
        self.running: list = []

    def submit(self, req: ImageRequest) -> None:
        self.waiting.append(req)

    def _admit(self) -> None:
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            if self.pipeline.pages_needed(self.waiting[0]) > self.pipeline.pool.free_pages:
                break  # FIFO: the head waits for pages rather than being overtaken
            admitted.append(self.pipeline.admit(self.waiting.pop(0)))
        if admitted:
            self.pipeline.prefill(admitted)
            self.running += admitted

    def iterate(self) -> list[ImageResult]:
        """One engine iteration: admit what fits, one step for all running, finish the done."""
        self._admit()
        if not self.running:
            return []
        self.pipeline.denoise_step(self.running)
        done = [s for s in self.running if s.done]
        self.running = [s for s in self.running if not s.done]
        return [self._finish(s) for s in done]

    def _finish(self, s) -> ImageResult:
        try:
            image = self.pipeline.decode(s)
        finally:
            self.pipeline.release(s)
        r = s.request
        return ImageResult(r.request_id, image.numpy(), s.seed, image.shape[0], image.shape[1], r.steps, s.times)

    def run(self, requests: Iterable[ImageRequest], progress=None) -> list[ImageResult]:
        """Run ``requests`` to completion; results in completion order."""
        for r in requests:
            self.submit(r)
        results = []
        while self.waiting or self.running:
            before = len(self.waiting) + len(self.running)
            results += self.iterate()
            if progress is not None:
                progress(results, self)
            if not self.running and self.waiting and before == len(self.waiting):
                raise RuntimeError(f"request {self.waiting[0].request_id} needs more KV pages than the pool has")
        return results
