"""The HTTP surface: a FastAPI app over an ``EngineLoop`` (OpenAI Images, vLLM-Omni chat, health, metrics).

Handlers never touch the pipeline: they validate, submit requests to the
engine thread, await its futures, encode images in a worker thread and
answer. A client that disconnects (or a handler that is cancelled, or a
request past its timeout) cancels its requests; the engine drops them at the
next step boundary and frees their KV pages.

Every error body has the OpenAI shape ``{"error": {"message", "type",
"param", "code", "request_id"}}``; bad input is a 400 naming the field, an
unknown model 404, overload 429 with Retry-After, not ready 503 with
Retry-After, a failure inside the pipeline 500 with a request id that the
server log also carries (``X-Request-Id`` on every response).
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from omni.request import ImageRequest, ImageResult
from omni.engine_loop import EngineLoop
from omni.scheduler import EngineUnavailable, QueueFull, RequestCancelled, RequestTooLarge

from .encode import encode_image
from .metrics import Metrics
from .schemas import BOT_TASKS, ChatCompletionRequest, GenerationParams, ImageGenerationRequest

log = logging.getLogger("omni.serving")

MAX_BODY_BYTES = 1 << 20
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 256, 4096, 4.0
MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
FALLBACK_DEFAULTS = SimpleNamespace(steps=50, guidance=5.0, size="1024x1024", shift=3.0, template="pretrain",
                                    system_prompt=None)


class APIError(Exception):
    """An answer other than 200, in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code, self.headers = code, headers or {}


class ClientGone(Exception):
    """The client disconnected before its images were ready."""


@dataclass(frozen=True)
class ModelHelpers:
    """Model-specific answers the API needs: size snapping and system-prompt modes."""

    parse_size: Callable[[str], tuple[int, int]]  # "WxH" -> (height, width); ValueError if malformed
    snap: Callable[[int, int], tuple[int, int]]  # requested (h, w) -> generated (h, w)
    system_prompt: Callable[[str | None], str | None]  # mode name or text -> text

    @classmethod
    def hunyuan_image3(cls) -> "ModelHelpers":
        from omni.models.hunyuan_image3 import resolution, system_prompts
        from omni.recipe import parse_size  # "WxH" -> (width, height); RecipeError is a ValueError

        modes = {"None", "dynamic", "custom", *system_prompts.SYSTEM_PROMPTS}

        def system_prompt(value: str | None) -> str | None:
            if value is None or value not in modes:
                return value  # None, or the text itself
            return system_prompts.resolve_system_prompt(value, bot_task="image")

        return cls(lambda size: parse_size(size)[::-1], lambda h, w: resolution.snap(h, w)[1:], system_prompt)


@dataclass(frozen=True)
class ServingOptions:
    model_id: str
    defaults: Any = field(default_factory=lambda: FALLBACK_DEFAULTS)  # a recipe's ``defaults`` section
    api_key: str | None = None
    request_timeout_s: float = 600.0
    max_prompt_chars: int = 8000
    max_queue: int | None = None  # n above this can never be queued: a 400, not a 429
    helpers: ModelHelpers | None = None

    @classmethod
    def from_recipe(cls, recipe, *, model_id: str, api_key: str | None = None, **kw) -> "ServingOptions":
        s = recipe.serving
        return cls(model_id=model_id, defaults=recipe.defaults, api_key=api_key,
                   request_timeout_s=s.request_timeout_s, max_queue=s.max_queue + s.max_running, **kw)


def create_app(engine: EngineLoop, options: ServingOptions) -> FastAPI:
    """The app serving ``engine``; its metrics registry is its own (``app.state.metrics``)."""
    app = FastAPI(title="omni-run", version="0.1.0", docs_url=None, redoc_url=None)
    api = _Api(engine, options, Metrics(engine))
    engine.on_step = lambda finished, dt: api.metrics.step.observe(dt)
    app.state.metrics, app.state.engine, app.state.api = api.metrics, engine, api

    @app.get("/health")
    async def health(request: Request):
        return await api.handle(request, "health", api.health, auth=False)

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(api.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return await api.handle(request, "models", api.models)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        return await api.handle(request, "models", lambda r, rid: api.model(model_id))

    @app.post("/v1/images/generations")
    async def images(request: Request):
        return await api.handle(request, "images", api.images)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await api.handle(request, "chat", api.chat)

    return app


class _Api:
    def __init__(self, engine: EngineLoop, options: ServingOptions, metrics: Metrics):
        self.engine, self.opt, self.metrics = engine, options, metrics
        self.helpers = options.helpers or ModelHelpers.hunyuan_image3()
        self.created = int(time.time())

    # ------------------------------------------------------------ plumbing

    async def handle(self, request: Request, endpoint: str, fn, auth: bool = True) -> Response:
        """Request id, auth, error mapping and metrics around one handler ``fn(request, rid)``."""
        rid = self._request_id(request)
        status = 500
        try:
            if auth:
                self._check_key(request)
            response = await fn(request, rid)
            status = response.status_code
        except APIError as e:
            status, response = e.status, _error_response(e, rid)
        except ClientGone:
            status, response = 499, Response(status_code=499)
            log.info("request %s: client disconnected; its requests were cancelled", rid)
        except Exception as e:  # a bug in this layer: still one request's failure
            log.error("request %s failed: %s: %s", rid, type(e).__name__, e, exc_info=e)
            status, response = 500, _error_response(_internal(rid), rid)
        response.headers["X-Request-Id"] = rid
        self.metrics.requests.labels(endpoint, str(status)).inc()
        return response

    @staticmethod
    def _request_id(request: Request) -> str:
        given = request.headers.get("x-request-id", "")
        return given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex[:16]

    def _check_key(self, request: Request) -> None:
        if self.opt.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.opt.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------ small endpoints

    async def health(self, request: Request, rid: str) -> Response:
        if self.engine.ready:
            return JSONResponse({"status": "ok", "model": self.opt.model_id})
        body = {"status": self.engine.status, "reason": self.engine.unavailable_reason()}
        headers = {"Retry-After": "5"} if self.engine.status == "starting" else {}
        return JSONResponse(body, status_code=503, headers=headers)

    async def models(self, request: Request, rid: str) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> Response:
        self._check_model(model_id)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.opt.model_id, "object": "model", "created": self.created, "owned_by": "omni-run"}

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.opt.model_id):
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.opt.model_id!r}",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------ generation endpoints

    async def images(self, request: Request, rid: str) -> Response:
        t0 = time.perf_counter()
        body = await _parse(request, ImageGenerationRequest)
        self._check_model(body.model)
        if body.response_format == "url":
            raise APIError(400, "response_format 'url' is not supported: this server keeps no image store; "
                                "use 'b64_json'", param="response_format", code="unsupported_value")
        if body.stream:
            raise APIError(400, "streaming (partial images) is not supported", param="stream")
        if body.background == "transparent":
            raise APIError(400, "background 'transparent' is not supported", param="background")
        h, w = self._size(body.size, "size")
        reqs = self._requests(rid, body, body.prompt, body.n, h, w, body.system_prompt)
        results = await self._generate(request, reqs, body)
        data = [{"b64_json": base64.b64encode(blob).decode(), "revised_prompt": None, "seed": r.seed,
                 **({"timings": r.times.as_dict()} if body.return_timings else {})} for r, blob in results]
        out = {"created": int(time.time()), "data": data, "output_format": body.output_format,
               "size": f"{results[0][0].width}x{results[0][0].height}"}
        if body.return_timings:
            out["timings"] = {"total": round(time.perf_counter() - t0, 6)}
        self._observe("images", t0, results)
        return JSONResponse(out)

    async def chat(self, request: Request, rid: str) -> Response:
        t0 = time.perf_counter()
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        modalities = body.modalities or ["image"]
        if modalities != ["image"]:
            raise APIError(400, f"modalities {modalities!r} are not supported: this server generates images only; "
                                "send modalities ['image']", param="modalities", code="unsupported_value")
        if body.stream:
            raise APIError(400, "streaming is not supported for image generation", param="stream")
        prompt, system = _chat_prompt(body.messages)
        if body.size is not None:
            h, w = self._size(body.size, "size")
        elif body.height is not None or body.width is not None:
            h, w = self._sides(body.height or body.width, body.width or body.height, "height/width")
        else:
            h, w = self._size(None, "size")
        n = body.num_outputs_per_prompt or body.n
        reqs = self._requests(rid, body, prompt, n, h, w, body.system_prompt or system)
        results = await self._generate(request, reqs, body)
        mime = MIME[body.output_format]
        content = [{"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(blob).decode()}"},
                    **({"timings": r.times.as_dict()} if body.return_timings else {})} for r, blob in results]
        out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
               "model": self.opt.model_id,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                            "finish_reason": "stop", "logprobs": None}],
               "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(results),
                         "total_tokens": len(prompt.split()) + len(results)}}
        if body.return_timings:
            out["timings"] = {"total": round(time.perf_counter() - t0, 6)}
        self._observe("chat", t0, results)
        return JSONResponse(out)

    # ------------------------------------------------------------ validation

    def _size(self, size: str | None, field: str) -> tuple[int, int]:
        if size is None or size == "auto":
            size = self.opt.defaults.size
        try:
            h, w = self.helpers.parse_size(size)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None
        return self._sides(h, w, field)

    def _sides(self, h: int, w: int, field: str) -> tuple[int, int]:
        if not (MIN_SIDE <= h <= MAX_SIDE and MIN_SIDE <= w <= MAX_SIDE):
            raise APIError(400, f"{field}: {w}x{h} (WxH) is out of range: each side must be between "
                                f"{MIN_SIDE} and {MAX_SIDE} pixels", param=field)
        if max(h / w, w / h) > MAX_ASPECT:
            raise APIError(400, f"{field}: {w}x{h} (WxH) has aspect ratio beyond {MAX_ASPECT:g}:1; the model "
                                f"generates between 1:{MAX_ASPECT:g} and {MAX_ASPECT:g}:1", param=field)
        return self.helpers.snap(h, w)

    def _requests(self, rid: str, p: GenerationParams, prompt: str, n: int, h: int, w: int,
                  system_prompt: str | None) -> list[ImageRequest]:
        d = self.opt.defaults
        self._check_text(prompt, "prompt", required=True)
        self._check_text(p.negative_prompt, "negative_prompt")
        if p.bot_task not in (None, "image"):
            if p.bot_task in BOT_TASKS:
                raise APIError(400, f"bot_task {p.bot_task!r} is not served yet: it needs the autoregressive "
                                    "stage; only 'image' (direct text-to-image) is available", param="bot_task")
            raise APIError(400, f"bot_task {p.bot_task!r} is unknown; allowed: {', '.join(BOT_TASKS)}",
                           param="bot_task")
        if self.opt.max_queue is not None and n > self.opt.max_queue:
            raise APIError(400, f"n={n} can never be queued here: at most {self.opt.max_queue} images are "
                                "accepted at once", param="n")
        system = self.helpers.system_prompt(system_prompt if system_prompt is not None else d.system_prompt)
        self._check_text(system, "system_prompt")
        steps = p.num_inference_steps or d.steps
        guidance = d.guidance if p.guidance_scale is None else p.guidance_scale
        return [ImageRequest(prompt=prompt, negative_prompt=p.negative_prompt, height=h, width=w, steps=steps,
                             guidance=guidance, seed=None if p.seed is None else p.seed + i, shift=d.shift,
                             template=d.template, system_prompt=system, step_cache=p.step_cache,
                             request_id=f"{rid}-{i}")
                for i in range(n)]

    def _check_text(self, text: str | None, field: str, required: bool = False) -> None:
        if text is None and not required:
            return
        if not text or not text.strip():
            raise APIError(400, f"{field} must not be empty", param=field)
        if len(text) > self.opt.max_prompt_chars:
            raise APIError(400, f"{field} is {len(text)} characters; the limit is {self.opt.max_prompt_chars}",
                           param=field)

    # ------------------------------------------------------------ running requests

    async def _generate(self, request: Request, reqs: list[ImageRequest],
                        body: GenerationParams) -> list[tuple[ImageResult, bytes]]:
        """Submit, await (watching for a disconnect and the timeout), then encode; cancels on any exit."""
        tickets = self._submit(reqs)
        try:
            results = await self._wait(request, tickets)
        finally:
            for t in tickets:
                if not _succeeded(t.future):
                    self.engine.cancel(t)
        return [(r, await self._encode(r, body.output_format, body.output_compression)) for r in results]

    def _submit(self, reqs: list[ImageRequest]):
        try:
            return self.engine.submit_many(reqs)
        except QueueFull as e:
            raise APIError(429, f"{e}; retry after {e.retry_after_s}s", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except RequestTooLarge as e:
            raise APIError(400, str(e), param="size", code="request_too_large") from None
        except EngineUnavailable as e:
            raise APIError(503, f"not ready: {e}", type="server_error", code="engine_unavailable",
                           headers={"Retry-After": "5"}) from None

    async def _wait(self, request: Request, tickets) -> list[ImageResult]:
        rid = tickets[0].request_id.rsplit("-", 1)[0]
        waits = [asyncio.wrap_future(t.future) for t in tickets]
        for w in waits:  # siblings of a failed image are cancelled: their errors are expected
            w.add_done_callback(lambda f: f.cancelled() or f.exception())
        gathered = asyncio.gather(*waits)
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        watcher = asyncio.create_task(_disconnected(request))
        try:
            done, _ = await asyncio.wait({gathered, watcher}, timeout=self.opt.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if gathered in done:
                return gathered.result()
            if watcher in done:
                raise ClientGone()
            raise APIError(504, f"request timed out after {self.opt.request_timeout_s:g}s "
                                "(serving.request_timeout_s) and was cancelled", type="server_error", code="timeout")
        except (APIError, ClientGone):
            raise
        except RequestCancelled:
            raise ClientGone() from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
        except Exception as e:
            log.error("request %s failed inside the pipeline: %s: %s (see the traceback of its image request)",
                      rid, type(e).__name__, e)
            raise _internal(rid) from None
        finally:
            watcher.cancel()
            gathered.cancel()

    async def _encode(self, r: ImageResult, fmt: str, quality: int | None) -> bytes:
        t0 = time.perf_counter()
        blob = await asyncio.to_thread(encode_image, r.image_HW3, fmt, quality)
        r.times.encode = time.perf_counter() - t0
        return blob

    def _observe(self, endpoint: str, t0: float, results) -> None:
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        self.metrics.images.inc(len(results))
        for r, _ in results:
            self.metrics.observe_stages(r.times.as_dict())


async def _parse(request: Request, model: type[BaseModel]):
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
    nested = data.pop("extra_body", None)  # curl-style vLLM-Omni clients nest the extras
    if isinstance(nested, dict):
        for key, value in nested.items():
            data.setdefault(key, value)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        field = ".".join(str(p) for p in errors[0]["loc"])
        detail = "; ".join(f"{'.'.join(str(p) for p in x['loc']) or 'body'}: {_reason(x)}" for x in errors)
        raise APIError(400, detail, param=field, code="invalid_value") from None
    return body


def _reason(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field"
    given = error.get("input")
    shown = "" if error["type"] == "missing" or isinstance(given, (dict, list)) else f" (got {given!r})"
    return error["msg"] + shown


def _chat_prompt(messages) -> tuple[str, str | None]:
    """The user text (all user messages joined) and the system messages' text, if any."""
    users, systems = [], []
    for i, m in enumerate(messages):
        texts = [m.content] if isinstance(m.content, str) else []
        for part in m.content if isinstance(m.content, list) else []:
            if part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                raise APIError(400, f"messages[{i}].content: part type {part.get('type')!r} is not supported; "
                                    "only text parts (image inputs / editing are not served yet)", param="messages")
        if m.role == "user":
            users += texts
        elif m.role in ("system", "developer"):
            systems += texts
    prompt = " ".join(t for t in users if t).strip()
    if not prompt:
        raise APIError(400, "messages: no user text to use as the prompt", param="messages")
    return prompt, ("\n".join(systems) if systems else None)


def _succeeded(future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _internal(rid: str) -> APIError:
    return APIError(500, f"internal error while generating; request id {rid} (the server log has the details)",
                    type="server_error", code="internal_error")


def _error_response(e: APIError, rid: str) -> JSONResponse:
    body = {"message": e.message, "type": e.type, "param": e.param, "code": e.code, "request_id": rid}
    return JSONResponse({"error": body}, status_code=e.status, headers=e.headers)


async def _disconnected(request: Request, poll_s: float = 0.2) -> None:
    """Return once the client has gone away."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)
