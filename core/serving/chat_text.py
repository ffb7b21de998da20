"""Chat completions answered in text: one OpenAI ``chat.completion``, or server-sent events as the answer grows.

The stream is OpenAI's: for each of the ``n`` choices a first chunk with
``delta.role``, then ``delta.content`` pieces (text_stream.py: append-only,
never re-sent), a chunk with ``finish_reason``; with
``stream_options.include_usage`` a last chunk with ``usage`` and no choices;
then ``data: [DONE]``. A failure after the stream began is one
``data: {"error": {...}}`` event (the ``openai`` client raises it) and the
end of the stream, without ``[DONE]``.

The engine publishes each ticket's cumulative answer on ``Ticket.updates``
(a thread-safe queue); the event loop polls it every 10 ms and never blocks
on it. A client that disconnects ends the stream: its tickets are cancelled
and their KV pages freed at the next step boundary. Tickets of multi-process
replicas have no ``updates``: their answer is one piece when it is done.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from omni.request import TextResult

from .errors import APIError, ClientGone, shutting_down
from .generation import Generator, failure
from .metrics import Metrics
from .options import ServingOptions
from .schemas import ChatCompletionRequest
from .text_requests import text_requests
from .text_stream import TextDeltas, latest_update
from .validation import ChatInput, RequestBuilder

log = logging.getLogger("omni.serving")

POLL_S = 0.01  # how often a stream looks at its tickets' updates
DISCONNECT_POLL_S = 0.2


class TextChat:
    """Text answers of ``POST /v1/chat/completions`` (``modalities: ["text"]``)."""

    def __init__(self, options: ServingOptions, builder: RequestBuilder, generator: Generator, metrics: Metrics):
        self.opt, self.builder, self.generator, self.metrics = options, builder, generator, metrics

    async def answer(self, request: Request, rid: str, body: ChatCompletionRequest, chat: ChatInput,
                     images: tuple, t0: float) -> Response:
        reqs = text_requests(rid, body, chat, images, self.builder)
        if body.stream:
            tickets = self.generator.submit(reqs, too_large="max_tokens")
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStream(self._events(request, rid, tickets, include_usage, t0))
        results = await self.generator.run(request, reqs, too_large="max_tokens")
        self._observe(results, t0)
        return JSONResponse(completion(rid, self.opt.model_id, results))

    async def _events(self, request: Request, rid: str, tickets, include_usage: bool, t0: float):
        """The SSE lines of one streamed call; its unfinished tickets are cancelled however it ends."""
        head = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.opt.model_id}
        extra = {"usage": None} if include_usage else {}
        results: list[TextResult | None] = [None] * len(tickets)
        try:
            for i in range(len(tickets)):
                yield _sse({**head, "choices": [_choice(i, {"role": "assistant", "content": ""})], **extra})
            async for i, piece, result in self._follow(request, tickets):
                if piece:
                    yield _sse({**head, "choices": [_choice(i, {"content": piece})], **extra})
                if result is not None:
                    results[i] = result
                    yield _sse({**head, "choices": [_choice(i, {}, result.finish_reason)], **extra})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage(results)})
            yield "data: [DONE]\n\n"
            self._observe(results, t0)
        except ClientGone:
            log.info("request %s: client disconnected mid-stream; its requests were cancelled", rid)
        except APIError as e:
            yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code,
                                  "request_id": rid}})
        finally:
            self.generator.cancel_unfinished(tickets)

    async def _follow(self, request: Request, tickets):
        """``(choice, new piece, TextResult or None)`` as the answers grow, until every one has finished.

        Raises ``ClientGone`` when the client leaves and an ``APIError`` for a failure or the timeout.
        """
        deltas = [TextDeltas() for _ in tickets]
        waiting = list(range(len(tickets)))
        deadline = time.monotonic() + self.generator.timeout_s
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while waiting:
            for i in list(waiting):
                t = tickets[i]
                finished = t.future.done()  # looked at first: no update published before it is missed
                text = latest_update(t)
                if text is not None:
                    yield i, deltas[i].push(text), None
                if finished:
                    result = _result(t, tickets)
                    yield i, _last_piece(deltas[i], result, t.request_id), result
                    waiting.remove(i)
            now = time.monotonic()
            if waiting and now > deadline:
                raise APIError(504, f"request timed out after {self.generator.timeout_s:g}s "
                                    "(serving.request_timeout_s) and was cancelled", type="server_error",
                               code="timeout")
            if waiting and now >= next_check:
                next_check = now + DISCONNECT_POLL_S
                if self.generator.closing:
                    raise shutting_down()
                if await request.is_disconnected():
                    raise ClientGone()
            if waiting:
                await asyncio.sleep(POLL_S)

    def _observe(self, results: list[TextResult], t0: float) -> None:
        self.metrics.latency.labels("chat").observe(time.perf_counter() - t0)
        self.metrics.text_tokens.inc(sum(len(r.token_ids) for r in results))


class EventStream(StreamingResponse):
    """``text/event-stream`` whose generator is always closed when the response ends (its ``finally``
    cancels the tickets at once, not whenever the generator is collected), and for which a client gone
    mid-send is the end of the stream, not an error."""

    def __init__(self, events):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            log.info("a streaming client disconnected")
        finally:
            await self.body_iterator.aclose()


def _result(ticket, tickets) -> TextResult:
    try:
        return ticket.future.result()
    except Exception as e:
        raise failure(e, tickets) from None


def _last_piece(deltas: TextDeltas, result: TextResult, request_id: str) -> str:
    piece = deltas.finish(result.text)
    if deltas.diverged:
        log.warning("request %s: the detokenizer revised text already streamed; the stream's text differs from "
                    "the final answer", request_id)
    return piece


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _choice(i: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": i, "delta": delta, "finish_reason": finish_reason, "logprobs": None}


def usage(results: list[TextResult]) -> dict:
    """OpenAI usage: the prompt counted once (every choice has the same), the completions' tokens summed
    (a stop token the model wrote counts: it was generated)."""
    prompt = results[0].prompt_tokens
    completion_tokens = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def completion(rid: str, model_id: str, results: list[TextResult]) -> dict:
    """The ``chat.completion`` body; each choice also reports the ``seed`` it was sampled with."""
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason,
                "logprobs": None, "seed": r.seed} for i, r in enumerate(results)]
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()), "model": model_id,
            "choices": choices, "usage": usage(results)}
