"""The endpoint handlers behind ``create_app``'s routes, and the plumbing around each call.

Handlers never touch the pipeline: they validate (validation.py; reference
images through image_input.py), hand the requests to the engine thread
(generation.py) and shape the answer; a chat asking for text goes on to
chat_text.py (text_requests.py decides which a chat asks for). The plumbing
gives every response an ``X-Request-Id``, checks the API key, maps
exceptions to OpenAI error bodies and counts requests by endpoint and status.
"""
from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import re
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from omni.engine_handle import EngineHandle

from .chat_text import TextChat
from .edit_form import read_edit_form
from .errors import APIError, ClientGone, error_response, internal_error, shutting_down
from .generation import Generator
from .image_input import (ImageInputError, ImageRules, check_count, data_uri_bytes, decode_images, does_not_edit,
                          fetch_url)
from .metrics import Metrics
from .options import ServingOptions
from .schemas import COT_TASKS, ChatCompletionRequest, GenerationParams, ImageEditRequest, ImageGenerationRequest
from .text_requests import wants_text
from .json_body import check_unicode, parse_body, validated
from .validation import RequestBuilder, SizePlan, chat_body_limit, chat_input, edit_body_limit, image_error

log = logging.getLogger("omni.serving")

MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a client's X-Request-Id is echoed only if it is this tame


class Api:
    def __init__(self, engine: EngineHandle, options: ServingOptions, metrics: Metrics):
        self.engine, self.opt, self.metrics = engine, options, metrics
        self.builder = RequestBuilder(options, options.helpers)
        self.generator = Generator(engine, options.request_timeout_s, options.png_level)
        self.rules = ImageRules(options.model_id, options.helpers.max_images, options.max_image_pixels,
                                options.max_image_bytes)
        self.text = TextChat(options, self.builder, self.generator, metrics)
        self.created = int(time.time())

    # ------------------------------------------------------------ plumbing

    async def handle(self, request: Request, endpoint: str, fn, auth: bool = True) -> Response:
        """Request id, auth, error mapping and metrics around one handler ``fn(request, rid)``."""
        rid = _request_id(request)
        status = 500
        try:
            if auth:
                self._check_key(request)
            if self.generator.closing and endpoint != "health":  # health says so itself
                raise shutting_down()
            response = await fn(request, rid)
            status = response.status_code
        except APIError as e:
            status, response = e.status, error_response(e, rid)
        except ClientGone:
            status, response = 499, Response(status_code=499)
            log.info("request %s: client disconnected; its requests were cancelled", rid)
        except Exception as e:  # a bug in this layer: still one request's failure
            log.error("request %s failed: %s: %s", rid, type(e).__name__, e, exc_info=e)
            status, response = 500, error_response(internal_error(rid), rid)
        response.headers["X-Request-Id"] = rid
        self.metrics.requests.labels(endpoint, str(status)).inc()
        return response

    def begin_shutdown(self) -> None:
        """The server was told to stop: calls in flight answer 503 now (their requests are cancelled)."""
        self.generator.closing = True

    def _check_key(self, request: Request) -> None:
        if not bearer_matches(request, self.opt.api_key):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    # ------------------------------------------------------------ small endpoints

    async def health(self, request: Request, rid: str) -> Response:
        if self.generator.closing:  # a load balancer stops sending here while the server drains
            return JSONResponse({"status": "stopping", "reason": "the server is shutting down"}, status_code=503,
                                headers={"Retry-After": "5"})
        if self.engine.ready:
            return JSONResponse({"status": "ok", "model": self.opt.model_id})
        body = {"status": self.engine.status, "reason": self.engine.unavailable_reason()}
        headers = {"Retry-After": "5"} if self.engine.status == "starting" else {}
        return JSONResponse(body, status_code=503, headers=headers)

    async def models(self, request: Request, rid: str) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, model_id: str) -> Response:
        self.builder.check_model(model_id)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.opt.model_id, "object": "model", "created": self.created, "owned_by": "omni-run"}

    # ------------------------------------------------------------ generation endpoints

    async def images(self, request: Request, rid: str) -> Response:
        t0 = time.perf_counter()
        body = await parse_body(request, ImageGenerationRequest)
        self.builder.check_model(body.model)
        _check_images_options(body)
        plan = self.builder.size(body.size, "size")
        reqs = self.builder.requests(rid, body, body.prompt, body.n, plan, body.system_prompt,
                                     auto_size=_auto_size(body))
        results = await self.generator.generate(request, reqs, body, _output(plan, body))
        out = _images_body(results, body, _output(plan, body))
        return self._answer("images", out, body, t0, results)

    async def edits(self, request: Request, rid: str) -> Response:
        """OpenAI Images edit: multipart form, 1..max_images reference images, the generations answer."""
        t0 = time.perf_counter()
        form = await read_edit_form(request, edit_body_limit(self.opt))
        check_unicode(form.values())
        body = validated(ImageEditRequest, form.values())
        self.builder.check_model(body.model)
        _check_images_options(body)
        images = await self._decoded(self._edit_images(form.images))
        plan = self.builder.edit_size(body.size, "size", images)
        reqs = self.builder.requests(rid, body, body.prompt, body.n, plan, body.system_prompt, images,
                                     auto_size=_auto_size(body))
        results = await self.generator.generate(request, reqs, body, _output(plan, body))
        return self._answer("edits", _images_body(results, body, _output(plan, body)), body, t0, results)

    async def chat(self, request: Request, rid: str) -> Response:
        """An image (modalities absent or ["image"]) or a text answer (["text"], chat_text.py)."""
        t0 = time.perf_counter()
        body = await parse_body(request, ChatCompletionRequest, chat_body_limit(self.opt))
        self.builder.check_model(body.model)
        text = wants_text(body, self.opt.helpers, self.opt.model_id)
        if body.stream and not text:
            raise APIError(400, "streaming is not supported for image generation (it is for text answers: "
                                "modalities ['text'])", param="stream")
        chat = chat_input(body.messages)
        images = await self._chat_images(chat.images)
        if text:
            return await self.text.answer(request, rid, body, chat, images, t0)
        plan = self._chat_size(body, images)
        n = self.builder.chat_count(body)
        system = body.system_prompt if body.system_prompt is not None else chat.system
        reqs = self.builder.requests(rid, body, chat.prompt, n, plan, system, images,
                                     auto_size=_auto_size(body))
        results = await self.generator.generate(request, reqs, body, _output(plan, body))
        out = self._chat_body(rid, chat.prompt, results, body)
        return self._answer("chat", out, body, t0, results)

    def _chat_size(self, body: ChatCompletionRequest, images: tuple) -> SizePlan:
        """``size`` wins; else height / width (one of them alone means a square); else the first reference
        image's size, else the default."""
        if body.size is not None:
            return self.builder.size(body.size, "size")
        if body.height is not None or body.width is not None:
            return self.builder.sides(body.height or body.width, body.width or body.height, "height/width")
        return self.builder.edit_size(None, "size", images)

    # ------------------------------------------------------------ reference images

    def _edit_images(self, parts: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """The uploaded files, of which an edit needs at least one (a model that does not edit takes none)."""
        if parts:
            return parts
        if self.rules.max_images == 0:
            raise image_error(does_not_edit("image", self.rules.model))
        raise APIError(400, f"image: no reference image was sent; send 1 to {self.rules.max_images} files as "
                            "'image' or 'image[]' parts", param="image")

    async def _decoded(self, parts: list[tuple[str, bytes]]) -> tuple:
        """The images decoded and checked off the event loop (Pillow holds the GIL only in part)."""
        try:
            return await asyncio.to_thread(decode_images, parts, self.rules)
        except ImageInputError as e:
            raise image_error(e) from None

    async def _chat_images(self, sources: list[tuple[str, str]]) -> tuple:
        """The chat's image_url parts: counted first, then each URL read (data URI or fetch), then decoded."""
        if not sources:
            return ()
        try:
            check_count([part for part, _ in sources], self.rules)
            blobs = [(part, await self._url_bytes(part, url)) for part, url in sources]
        except ImageInputError as e:
            raise image_error(e) from None
        return await self._decoded(blobs)

    async def _url_bytes(self, part: str, url: str) -> bytes:
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return data_uri_bytes(url, part, self.opt.max_image_bytes)
        if scheme not in ("http", "https"):
            raise ImageInputError(part, f"image URL scheme {scheme or url[:16]!r} is not supported; send a data URI "
                                        "(data:image/png;base64,...)")
        if not self.opt.fetch_remote_images:
            raise ImageInputError(part, "remote image URLs are not fetched by this server "
                                        "(serving.fetch_remote_images is false); send the image as a data URI "
                                        "(data:image/png;base64,...)")
        return await fetch_url(url, part, self.opt.max_image_bytes, self.opt.fetch_timeout_s)

    def _chat_body(self, rid: str, prompt: str, results, body: ChatCompletionRequest) -> dict:
        mime = MIME[body.output_format]
        content = []
        for r, blob in results:  # with a CoT bot_task, the text the model wrote comes before its image
            if r.revised_prompt is not None:
                content.append({"type": "text", "text": r.revised_prompt})
            content.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,"
                                                                      f"{base64.b64encode(blob).decode()}"},
                            "native_size": f"{r.width}x{r.height}", **_timings(r, body)})
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
                "model": self.opt.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop", "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(results),
                          "total_tokens": len(prompt.split()) + len(results)}}

    def _answer(self, endpoint: str, out: dict, body: GenerationParams, t0: float, results) -> Response:
        """The 200 answer, with the call's total time if asked for; observed in the metrics."""
        if body.return_timings:
            out["timings"] = {"total": round(time.perf_counter() - t0, 6)}
        self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
        self.metrics.images.inc(len(results))
        for r, _ in results:
            self.metrics.observe_stages(r.times.as_dict())
        return JSONResponse(out)


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex[:16]


def _check_images_options(body: ImageGenerationRequest | ImageEditRequest) -> None:
    if body.response_format == "url":
        raise APIError(400, "response_format 'url' is not supported: this server keeps no image store; "
                            "use 'b64_json'", param="response_format", code="unsupported_value")
    if body.stream:
        raise APIError(400, "streaming (partial images) is not supported", param="stream")
    if body.background == "transparent":
        raise APIError(400, "background 'transparent' is not supported", param="background")


def _auto_size(body: GenerationParams) -> bool:
    """size "auto" with a CoT bot_task: the model picks the aspect ratio after its CoT."""
    return getattr(body, "size", None) == "auto" and body.bot_task in COT_TASKS


def _output(plan: SizePlan, body: GenerationParams) -> tuple[int, int] | None:
    """The (h, w) the client gets; None (native, untouched) also when the model picks the ratio after its CoT."""
    return None if _auto_size(body) else plan.output


def _images_body(results, body: ImageGenerationRequest | ImageEditRequest, output: tuple[int, int] | None) -> dict:
    """``size``: what the images are; ``native_size``: what the model generated before the fit."""
    first = results[0][0]
    h, w = output or (first.height, first.width)
    data = [{"b64_json": base64.b64encode(blob).decode(), "revised_prompt": r.revised_prompt, "seed": r.seed,
             **_timings(r, body)} for r, blob in results]
    return {"created": int(time.time()), "data": data, "output_format": body.output_format, "size": f"{w}x{h}",
            "native_size": f"{first.width}x{first.height}"}


def _timings(r, body: GenerationParams) -> dict:
    return {"timings": r.times.as_dict()} if body.return_timings else {}


def bearer_matches(request: Request, api_key: str | None) -> bool:
    """No key set, or ``Authorization: Bearer <key>`` (compared in constant time)."""
    if api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
