"""A chat body that asks for a text answer: which modality it asks for, and its checked ``TextRequest``s.

Modalities: absent (or ``["image"]``, or ``[]``) is an image, as vLLM-Omni image
clients expect; ``["text"]`` is a text answer, on a model that writes text
(``ModelHelpers.writes_text``, the Instruct flavours). Anything else is a
400 naming ``modalities``.

A text answer is single-turn: the user messages' text (joined) is the
prompt, their ``image_url`` parts are its images (I2T), system / developer
messages the system prompt. Earlier assistant turns are refused rather than
silently dropped. Sampling defaults are the Instruct generation_config
(``TextRequest``'s: temperature 0.6, top_k 1024, top_p 0.95) and 256 tokens.
Image-only fields and OpenAI fields this server cannot honour exactly
(``stop`` strings, penalties, logprobs) are 400s naming them, never ignored.
"""
from __future__ import annotations

from omni.request import TextRequest

from .errors import APIError
from .options import ModelHelpers
from .schemas import MAX_TEMPERATURE, MAX_TEXT_TOKENS, MIN_TEMPERATURE, MIN_TOP_P, ChatCompletionRequest
from .validation import ChatInput, RequestBuilder

DEFAULT_MAX_TOKENS = 256  # TextRequest's default
TEXT_ROLES = ("user", "system", "developer")
IMAGE_ONLY = ("size", "height", "width", "num_inference_steps", "guidance_scale", "negative_prompt", "step_cache",
              "bot_task", "drop_think", "cot_max_tokens", "output_format", "output_compression", "return_timings")


def wants_text(body: ChatCompletionRequest, helpers: ModelHelpers, model_id: str) -> bool:
    """True for ``modalities: ["text"]`` on a model that writes text; False for an image (absent or ["image"])."""
    modalities = body.modalities
    if not modalities or modalities == ["image"]:  # absent, null or []: an image, as before text answers
        return False
    if modalities != ["text"]:
        raise APIError(400, f"modalities {modalities!r} are not supported: send ['image'] (the default) for an "
                            "image or ['text'] for a text answer", param="modalities", code="unsupported_value")
    if not helpers.writes_text:
        raise APIError(400, f"modalities ['text']: model {model_id} does not write text answers (it draws images "
                            "only; an Instruct flavour does); send modalities ['image']", param="modalities",
                       code="unsupported_value")
    return True


def text_requests(rid: str, body: ChatCompletionRequest, chat: ChatInput, images: tuple,
                  builder: RequestBuilder) -> list[TextRequest]:
    """``n`` answers ``{rid}-{i}`` to the chat's prompt; answer i gets seed + i (n answers differ)."""
    _check_roles(body)
    _check_fields(body)
    builder.check_text(chat.prompt, "prompt", required=True)
    n = builder.chat_count(body)
    system = builder.system_prompt(body.system_prompt if body.system_prompt is not None else chat.system, "text")
    sampling = _sampling(body)
    return [TextRequest(prompt=chat.prompt, images=tuple(images), system_prompt=system,
                        seed=None if body.seed is None else body.seed + i, request_id=f"{rid}-{i}", **sampling)
            for i in range(n)]


def _check_roles(body: ChatCompletionRequest) -> None:
    for i, m in enumerate(body.messages):
        if m.role not in TEXT_ROLES:
            raise APIError(400, f"messages[{i}]: {m.role!r} messages are not supported: a text answer is "
                                "single-turn (user text and images, system prompt); send the conversation so "
                                "far as the user text if the model needs it", param=f"messages[{i}]")


def _check_fields(body: ChatCompletionRequest) -> None:
    """Refuse what a text answer cannot honour: image fields, stop strings, penalties, logprobs."""
    given = body.model_fields_set
    for name in IMAGE_ONLY:
        value = getattr(body, name)
        if name in given and value is not None and value is not False:  # false / null: asks for nothing
            raise APIError(400, f"{name} applies to images, not to a text answer (modalities ['text'])", param=name)
    if body.stop not in (None, "", []):
        raise APIError(400, "stop sequences are not supported: the answer ends at the model's own stop token or "
                            "after max_tokens; cut the text on your side", param="stop", code="unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported (0 only)", param=name, code="unsupported_parameter")
    if body.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs", code="unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


def _sampling(body: ChatCompletionRequest) -> dict:
    """max_tokens, temperature, top_p, top_k as given (checked); absent ones keep TextRequest's defaults."""
    out = {"max_tokens": _max_tokens(body)}
    if body.temperature is not None:
        if not temperature_ok(body.temperature):
            raise APIError(400, f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and "
                                f"{MAX_TEMPERATURE:g}, got {body.temperature:g}", param="temperature")
        out["temperature"] = body.temperature
    if body.top_p is not None:
        if not MIN_TOP_P <= body.top_p <= 1:
            raise APIError(400, f"top_p must be between {MIN_TOP_P:g} and 1, got {body.top_p:g}", param="top_p")
        out["top_p"] = body.top_p
    if body.top_k is not None:
        if body.top_k < 0:
            raise APIError(400, f"top_k must be >= 0 (0 = no top-k cut), got {body.top_k}", param="top_k")
        out["top_k"] = body.top_k
    return out


def temperature_ok(t: float) -> bool:
    """0 (greedy) or MIN..MAX: a smaller positive one would overflow the logits it divides (a failed step)."""
    return t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE


def _max_tokens(body: ChatCompletionRequest) -> int:
    """``max_completion_tokens`` (OpenAI's current name) or ``max_tokens``; both given must agree."""
    a, b = body.max_completion_tokens, body.max_tokens
    if a is not None and b is not None and a != b:
        raise APIError(400, f"max_completion_tokens ({a}) and max_tokens ({b}) disagree; send one of them",
                       param="max_tokens")
    field, value = ("max_completion_tokens", a) if a is not None else ("max_tokens", b)
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not 1 <= value <= MAX_TEXT_TOKENS:
        raise APIError(400, f"{field} must be between 1 and {MAX_TEXT_TOKENS}, got {value}", param=field)
    return value
