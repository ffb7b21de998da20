"""From an HTTP body to checked ``ImageRequest``s: body limits, JSON parsing, deployment limits, sizes, chat prompts.

Static limits live in schemas.py; the limits here depend on the deployment
(the model, its sizes, the queue, prompt length, how many reference images it
takes). Every violation is an ``APIError`` 400 (404 for an unknown model, 413
for a body past its limit) naming the field.

Body limits: a JSON body without images is at most ``MAX_BODY_BYTES``; a
chat body may also carry ``max_images`` base64 data URIs of
``max_image_bytes`` each, an edit upload ``max_images`` files of
``max_image_bytes`` each (one more MiB for the other fields either way).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from omni.request import ImageRequest

from .errors import APIError, ClientGone
from .image_input import ImageInputError, reference_size
from .options import ModelHelpers, ServingOptions
from .schemas import BOT_TASKS, COT_TASKS, GenerationParams

MAX_BODY_BYTES = 1 << 20
DRAIN_FACTOR = 4  # past its limit a body is still read (and dropped) up to this many limits, so the 413 arrives
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 256, 4096, 4.0


def chat_body_limit(opt: ServingOptions) -> int:
    """Bytes a chat body may have: the JSON limit, plus room for the model's reference images as base64."""
    return MAX_BODY_BYTES + opt.helpers.max_images * 4 * -(-opt.max_image_bytes // 3)


def edit_body_limit(opt: ServingOptions) -> int:
    """Bytes an edit upload may have (room for one image even where the model takes none, to say so clearly)."""
    return MAX_BODY_BYTES + max(1, opt.helpers.max_images) * opt.max_image_bytes


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 once it passes ``limit`` bytes (declared or streamed).

    Past the limit the rest is read and dropped (up to ``DRAIN_FACTOR`` limits)
    instead of closing on a client still sending, which would lose the answer.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_FACTOR * limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > DRAIN_FACTOR * limit:
                break
    except ClientDisconnect:
        raise ClientGone() from None
    if size > limit:
        raise _too_large(size, limit)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body is {size} bytes; the limit is {limit}", code="payload_too_large")


def image_error(e: ImageInputError) -> APIError:
    """The answer to a refused reference image: 400 (413 for its bytes) naming the part."""
    return APIError(e.status, str(e), param=e.part, code="image_too_large" if e.status == 413 else "invalid_image")


async def parse_body(request: Request, model: type[BaseModel], limit: int = MAX_BODY_BYTES):
    raw = await read_body(request, limit)
    data = _json_object(raw)
    nested = data.pop("extra_body", None)  # curl-style vLLM-Omni clients nest the extras
    if isinstance(nested, dict):
        for key, value in nested.items():
            data.setdefault(key, value)
    return validated(model, data)


def _json_object(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
    return data


def validated(model: type[BaseModel], data: dict):
    """``data`` as ``model``; the first bad field is the error's ``param``, every bad field is in its message."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        field = ".".join(str(p) for p in errors[0]["loc"])
        detail = "; ".join(f"{'.'.join(str(p) for p in x['loc']) or 'body'}: {_reason(x)}" for x in errors)
        raise APIError(400, detail, param=field, code="invalid_value") from None


def _reason(error: dict) -> str:
    if error["type"] == "extra_forbidden":
        return "unknown field"
    given = error.get("input")
    shown = "" if error["type"] == "missing" or isinstance(given, (dict, list)) else f" (got {given!r})"
    return error["msg"] + shown


@dataclass
class ChatInput:
    """What the chat messages ask for: the prompt, the system text, the reference images' URLs in order."""

    prompt: str
    system: str | None
    images: list[tuple[str, str]] = field(default_factory=list)  # (part name, url) of user image_url parts


def chat_input(messages) -> ChatInput:
    """The user text (all user messages joined), the system messages' text, the user messages' image URLs."""
    users, systems, images = [], [], []
    for i, m in enumerate(messages):
        texts = _message_parts(i, m, images)
        if m.role == "user":
            users += texts
        elif m.role in ("system", "developer"):
            systems += texts
    prompt = " ".join(t for t in users if t).strip()
    if not prompt:
        raise APIError(400, "messages: no user text to use as the prompt", param="messages")
    return ChatInput(prompt, "\n".join(systems) if systems else None, images)


def _message_parts(i: int, m, images: list[tuple[str, str]]) -> list[str]:
    """The message's texts; its image_url parts are appended to ``images`` (user messages only)."""
    texts = [m.content] if isinstance(m.content, str) else []
    for j, part in enumerate(m.content if isinstance(m.content, list) else []):
        name, kind = f"messages[{i}].content[{j}]", part.get("type")
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind == "image_url":
            images.append((name, _image_url(name, m.role, part)))
        else:
            raise APIError(400, f"{name}: part type {kind!r} is not supported; only 'text' and 'image_url' parts",
                           param=name)
    return texts


def _image_url(name: str, role: str, part: dict) -> str:
    if role != "user":
        raise APIError(400, f"{name}: image_url parts are taken from user messages only, not {role!r} ones",
                       param=name)
    given = part.get("image_url")
    url = given.get("url") if isinstance(given, dict) else given
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{name}: expected {{'type': 'image_url', 'image_url': {{'url': "
                            "'data:image/png;base64,...'}}}", param=name)
    return url


class RequestBuilder:
    """Checks a parsed body against this deployment and turns it into the engine's requests."""

    def __init__(self, options: ServingOptions, helpers: ModelHelpers):
        self.opt, self.helpers = options, helpers

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.opt.model_id):
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.opt.model_id!r}",
                           param="model", code="model_not_found")

    def size(self, size: str | None, field: str) -> tuple[int, int]:
        """(height, width) to generate for a "WxH" size (None or "auto": the recipe's default)."""
        if size is None or size == "auto":
            size = self.opt.defaults.size
        try:
            h, w = self.helpers.parse_size(size)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None
        return self.sides(h, w, field)

    def sides(self, h: int, w: int, field: str) -> tuple[int, int]:
        _check_sides(h, w, field)
        return self.helpers.snap(h, w)

    def edit_size(self, size: str | None, field: str, images: tuple) -> tuple[int, int]:
        """An explicit size as ``size`` does; none (or "auto") follows the first reference image.

        That size is the model's snap of image 0's (h, w), taken as the model gives it: the side range
        here bounds what clients ask for, and a model's own rule may go below it (the 256-base tiny
        Instruct table does).
        """
        if (size is not None and size != "auto") or not images:
            return self.size(size, field)
        return reference_size(self.helpers, images[0])

    def requests(self, rid: str, p: GenerationParams, prompt: str, n: int, h: int, w: int,
                 system_prompt: str | None, images: tuple = (), auto_size: bool = False) -> list[ImageRequest]:
        """``n`` requests ``{rid}-{i}``; image i gets seed + i so that one call's images differ.

        ``images`` (decoded reference images, checked by image_input) are shared by all ``n``: each
        output is an edit of the same inputs. ``auto_size`` (size "auto" with a CoT bot_task): the
        model picks the aspect ratio after its CoT, and ``h`` / ``w`` only bound the pages it is priced at.
        """
        d = self.opt.defaults
        self.check_text(prompt, "prompt", required=True)
        self.check_text(p.negative_prompt, "negative_prompt")
        bot_task = self._bot_task(p)
        self.check_n(n)
        system = self.system_prompt(system_prompt, bot_task)
        steps = p.num_inference_steps or d.steps
        guidance = d.guidance if p.guidance_scale is None else p.guidance_scale
        cot = {"cot_max_tokens": p.cot_max_tokens} if p.cot_max_tokens is not None else {}
        return [ImageRequest(prompt=prompt, negative_prompt=p.negative_prompt, height=h, width=w, steps=steps,
                             guidance=guidance, seed=None if p.seed is None else p.seed + i, shift=d.shift,
                             template=d.template, system_prompt=system, step_cache=p.step_cache,
                             images=tuple(images), request_id=f"{rid}-{i}", bot_task=bot_task,
                             drop_think=bool(p.drop_think), auto_size=auto_size and bot_task in COT_TASKS, **cot)
                for i in range(n)]

    def system_prompt(self, given: str | None, bot_task: str) -> str | None:
        """The system prompt text: the request's (a mode name or the text), else the recipe's, resolved for
        ``bot_task`` (``dynamic`` picks per task, as the official mapping does)."""
        value = given if given is not None else self.opt.defaults.system_prompt
        system = self.helpers.system_prompt(value, bot_task=bot_task)
        self.check_text(system, "system_prompt")
        return system

    def _bot_task(self, p: GenerationParams) -> str:
        """The bot task; a CoT task (and the CoT fields) only on a model that writes text."""
        bot_task = p.bot_task or "image"
        if bot_task not in BOT_TASKS:
            raise APIError(400, f"bot_task {bot_task!r} is unknown; allowed: {', '.join(BOT_TASKS)}",
                           param="bot_task")
        if bot_task != "image" and not self.helpers.writes_text:
            raise APIError(400, f"bot_task {bot_task!r} needs a model that writes text (an Instruct flavour); "
                                f"model {self.opt.model_id} draws directly: use bot_task 'image'",
                           param="bot_task", code="unsupported_value")
        if p.drop_think and bot_task not in ("think", "think_recaption"):
            raise APIError(400, f"drop_think applies to bot_task think or think_recaption (a CoT with a <think> "
                                f"section), not {bot_task!r}", param="drop_think")
        if p.cot_max_tokens is not None and bot_task == "image":
            raise APIError(400, "cot_max_tokens applies to a bot_task that writes a CoT (recaption, think, "
                                "think_recaption), not 'image'", param="cot_max_tokens")
        return bot_task

    def check_n(self, n: int) -> None:
        if self.opt.max_queue is not None and n > self.opt.max_queue:
            raise APIError(400, f"n={n} can never be queued here: at most {self.opt.max_queue} requests are "
                                "accepted at once", param="n")

    def check_text(self, text: str | None, field: str, required: bool = False) -> None:
        if text is None and not required:
            return
        if not text or not text.strip():
            raise APIError(400, f"{field} must not be empty", param=field)
        if len(text) > self.opt.max_prompt_chars:
            raise APIError(400, f"{field} is {len(text)} characters; the limit is {self.opt.max_prompt_chars}",
                           param=field)


def _check_sides(h: int, w: int, field: str) -> None:
    if not (MIN_SIDE <= h <= MAX_SIDE and MIN_SIDE <= w <= MAX_SIDE):
        raise APIError(400, f"{field}: {w}x{h} (WxH) is out of range: each side must be between "
                            f"{MIN_SIDE} and {MAX_SIDE} pixels", param=field)
    if max(h / w, w / h) > MAX_ASPECT:
        raise APIError(400, f"{field}: {w}x{h} (WxH) has aspect ratio beyond {MAX_ASPECT:g}:1; the model "
                            f"generates between 1:{MAX_ASPECT:g} and {MAX_ASPECT:g}:1", param=field)
