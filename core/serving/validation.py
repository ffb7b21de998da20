"""From an HTTP body to checked ``ImageRequest``s: JSON parsing, deployment limits, sizes, chat prompts.

Static limits live in schemas.py; the limits here depend on the deployment
(the model, its sizes, the queue, prompt length). Every violation is an
``APIError`` 400 (404 for an unknown model, 413 for a huge body) naming the field.
"""
from __future__ import annotations

import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from omni.request import ImageRequest

from .errors import APIError
from .options import ModelHelpers, ServingOptions
from .schemas import BOT_TASKS, GenerationParams

MAX_BODY_BYTES = 1 << 20
MIN_SIDE, MAX_SIDE, MAX_ASPECT = 256, 4096, 4.0


async def parse_body(request: Request, model: type[BaseModel]):
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    data = _json_object(raw)
    nested = data.pop("extra_body", None)  # curl-style vLLM-Omni clients nest the extras
    if isinstance(nested, dict):
        for key, value in nested.items():
            data.setdefault(key, value)
    return _validated(model, data)


def _json_object(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}", code="invalid_json")
    return data


def _validated(model: type[BaseModel], data: dict):
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


def chat_prompt(messages) -> tuple[str, str | None]:
    """The user text (all user messages joined) and the system messages' text, if any."""
    users, systems = [], []
    for i, m in enumerate(messages):
        texts = _message_texts(i, m)
        if m.role == "user":
            users += texts
        elif m.role in ("system", "developer"):
            systems += texts
    prompt = " ".join(t for t in users if t).strip()
    if not prompt:
        raise APIError(400, "messages: no user text to use as the prompt", param="messages")
    return prompt, ("\n".join(systems) if systems else None)


def _message_texts(i: int, m) -> list[str]:
    texts = [m.content] if isinstance(m.content, str) else []
    for part in m.content if isinstance(m.content, list) else []:
        if part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        else:
            raise APIError(400, f"messages[{i}].content: part type {part.get('type')!r} is not supported; "
                                "only text parts (image inputs / editing are not served yet)", param="messages")
    return texts


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
        if not (MIN_SIDE <= h <= MAX_SIDE and MIN_SIDE <= w <= MAX_SIDE):
            raise APIError(400, f"{field}: {w}x{h} (WxH) is out of range: each side must be between "
                                f"{MIN_SIDE} and {MAX_SIDE} pixels", param=field)
        if max(h / w, w / h) > MAX_ASPECT:
            raise APIError(400, f"{field}: {w}x{h} (WxH) has aspect ratio beyond {MAX_ASPECT:g}:1; the model "
                                f"generates between 1:{MAX_ASPECT:g} and {MAX_ASPECT:g}:1", param=field)
        return self.helpers.snap(h, w)

    def requests(self, rid: str, p: GenerationParams, prompt: str, n: int, h: int, w: int,
                 system_prompt: str | None) -> list[ImageRequest]:
        """``n`` requests ``{rid}-{i}``; image i gets seed + i so that one call's images differ."""
        d = self.opt.defaults
        self._check_text(prompt, "prompt", required=True)
        self._check_text(p.negative_prompt, "negative_prompt")
        _check_bot_task(p.bot_task)
        self._check_n(n)
        system = self.helpers.system_prompt(system_prompt if system_prompt is not None else d.system_prompt)
        self._check_text(system, "system_prompt")
        steps = p.num_inference_steps or d.steps
        guidance = d.guidance if p.guidance_scale is None else p.guidance_scale
        return [ImageRequest(prompt=prompt, negative_prompt=p.negative_prompt, height=h, width=w, steps=steps,
                             guidance=guidance, seed=None if p.seed is None else p.seed + i, shift=d.shift,
                             template=d.template, system_prompt=system, step_cache=p.step_cache,
                             request_id=f"{rid}-{i}")
                for i in range(n)]

    def _check_n(self, n: int) -> None:
        if self.opt.max_queue is not None and n > self.opt.max_queue:
            raise APIError(400, f"n={n} can never be queued here: at most {self.opt.max_queue} images are "
                                "accepted at once", param="n")

    def _check_text(self, text: str | None, field: str, required: bool = False) -> None:
        if text is None and not required:
            return
        if not text or not text.strip():
            raise APIError(400, f"{field} must not be empty", param=field)
        if len(text) > self.opt.max_prompt_chars:
            raise APIError(400, f"{field} is {len(text)} characters; the limit is {self.opt.max_prompt_chars}",
                           param=field)


def _check_bot_task(bot_task: str | None) -> None:
    if bot_task in (None, "image"):
        return
    if bot_task in BOT_TASKS:
        raise APIError(400, f"bot_task {bot_task!r} is not served yet: it needs the autoregressive "
                            "stage; only 'image' (direct text-to-image) is available", param="bot_task")
    raise APIError(400, f"bot_task {bot_task!r} is unknown; allowed: {', '.join(BOT_TASKS)}", param="bot_task")
