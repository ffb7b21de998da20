"""Running one HTTP call's requests on the engine thread: submit, wait, cancel, encode.

A client that disconnects (or a handler that is cancelled, or a request past
its timeout) cancels its requests; the engine drops them at the next step
boundary and frees their KV pages. Text answers use the same submit, wait and
cancel (``run``); a stream (chat_text.py) submits and cancels here and maps
its failures with ``failure``.
"""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request

from omni.engine_handle import EngineHandle
from omni.request import ImageRequest, ImageResult
from omni.scheduler_errors import EngineUnavailable, QueueFull, RequestCancelled, RequestInvalid, RequestTooLarge

from .encode import PNG_LEVEL, encode_image
from .errors import APIError, ClientGone, internal_error, shutting_down, submit_refused
from .resize import fit_image
from .schemas import GenerationParams

log = logging.getLogger("omni.serving")


class Generator:
    """Hands requests to ``engine`` and turns their futures into encoded images, or an ``APIError``."""

    def __init__(self, engine: EngineHandle, request_timeout_s: float, png_level: int = PNG_LEVEL):
        self.engine, self.timeout_s, self.png_level = engine, request_timeout_s, png_level
        self.closing = False  # set when the server is told to stop: waiting calls answer 503 at once

    async def generate(self, request: Request, reqs: list[ImageRequest], body: GenerationParams,
                       output: tuple[int, int] | None = None) -> list[tuple[ImageResult, bytes]]:
        """Submit, await (watching for a disconnect and the timeout), then fit to ``output`` (h, w; None: the
        native size) and encode; cancels on any exit."""
        results = await self.run(request, reqs)
        return [(r, await _encode(r, body.output_format, body.output_compression, output, self.png_level))
                for r in results]

    async def run(self, request: Request, reqs: list, too_large: str = "size") -> list:
        """The requests' results (images or text answers); every unfinished one is cancelled on any exit.

        ``too_large`` names the field to blame when a request can never fit the KV pool.
        """
        tickets = self.submit(reqs, too_large)
        try:
            return await self._wait(request, tickets)
        finally:
            self.cancel_unfinished(tickets)

    def submit(self, reqs: list, too_large: str = "size"):
        try:
            return self.engine.submit_many(reqs)
        except (QueueFull, RequestTooLarge, RequestInvalid, EngineUnavailable) as e:
            raise submit_refused(e, too_large) from None

    def cancel_unfinished(self, tickets) -> None:
        """Cancel every ticket without a result (their pages are freed at the next step boundary)."""
        for t in tickets:
            if not _succeeded(t.future):
                self.engine.cancel(t)

    async def _wait(self, request: Request, tickets) -> list:
        """The results, with every way of not getting them mapped to ``ClientGone`` or an ``APIError``."""
        try:
            return await self._race(request, tickets)
        except (APIError, ClientGone):
            raise
        except Exception as e:
            raise failure(e, tickets) from None

    async def _race(self, request: Request, tickets) -> list[ImageResult]:
        """The tickets' results, unless the client leaves or the timeout passes first."""
        waits = [asyncio.wrap_future(t.future) for t in tickets]
        for w in waits:  # siblings of a failed image are cancelled: their errors are expected
            w.add_done_callback(lambda f: f.cancelled() or f.exception())
        gathered = asyncio.gather(*waits)
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        watcher = asyncio.create_task(self._gone_or_closing(request))
        try:
            done, _ = await asyncio.wait({gathered, watcher}, timeout=self.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gathered in done:
                return gathered.result()
            if watcher in done:
                raise shutting_down() if self.closing else ClientGone()
            raise APIError(504, f"request timed out after {self.timeout_s:g}s "
                                "(serving.request_timeout_s) and was cancelled", type="server_error", code="timeout")
        finally:
            watcher.cancel()
            gathered.cancel()

    async def _gone_or_closing(self, request: Request, poll_s: float = 0.2) -> None:
        """Return once the client has gone away or the server is closing (polled: a signal handler sets it)."""
        while not self.closing and not await request.is_disconnected():
            await asyncio.sleep(poll_s)


def failure(e: BaseException, tickets) -> APIError | ClientGone:
    """What a request's failure means to its client: it was cancelled (gone), the engine is down, or a 500."""
    if isinstance(e, RequestCancelled):
        return ClientGone()
    if isinstance(e, EngineUnavailable):
        return APIError(503, str(e), type="server_error", code="engine_unavailable", headers={"Retry-After": "5"})
    rid = tickets[0].request_id.rsplit("-", 1)[0]
    log.error("request %s failed inside the pipeline: %s: %s (see the traceback of its engine request)",
              rid, type(e).__name__, e)
    return internal_error(rid)


async def _encode(r: ImageResult, fmt: str, quality: int | None, output: tuple[int, int] | None,
                  png_level: int) -> bytes:
    """Resized to ``output`` and encoded off the event loop, so other requests keep being answered meanwhile
    (the ``encode`` stage counts both)."""
    t0 = time.perf_counter()
    blob = await asyncio.to_thread(_fit_and_encode, r.image_HW3, output, fmt, quality, png_level)
    r.times.encode = time.perf_counter() - t0
    return blob


def _fit_and_encode(image_HW3, output: tuple[int, int] | None, fmt: str, quality: int | None,
                    png_level: int) -> bytes:
    return encode_image(image_HW3 if output is None else fit_image(image_HW3, *output), fmt, quality, png_level)


def _succeeded(future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None
