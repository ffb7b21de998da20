"""Request and response bodies of the HTTP API (OpenAI Images and vLLM-Omni chat shapes).

Static limits (values in limits.py, which the CLI shares without pydantic)
live in the field declarations (a violation is a 400 naming the field);
limits that depend on the deployment (n against the queue, prompt length)
are checked in validation.py with the same error shape.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .limits import (BOT_TASKS, COT_TASKS, MAX_GUIDANCE, MAX_N, MAX_SEED, MAX_STEPS,  # noqa: F401 (re-exported)
                     MAX_TEMPERATURE, MAX_TEXT_TOKENS, MIN_TEMPERATURE, MIN_TOP_P, OUTPUT_FORMATS)


class GenerationParams(BaseModel):
    """Diffusion extras shared by both endpoints (top level, or the SDK's flattened ``extra_body``)."""

    model_config = ConfigDict(extra="forbid")

    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="noise seed; image i of n uses seed + i (so that "
                                                                  "seed + n - 1 always fits 64 bits)")
    num_inference_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="denoising steps")
    guidance_scale: float | None = Field(None, ge=0.0, le=MAX_GUIDANCE,
                                         description="classifier-free guidance; <= 1 disables CFG")
    negative_prompt: str | None = Field(None, description="text of the unconditional row (default: the <cfg> row)")
    system_prompt: str | None = Field(
        None, description="a system prompt mode (None, dynamic, en_vanilla, en_recaption, en_think_recaption, "
                          "en_unified) or the text itself")
    bot_task: str | None = Field(None, description="image (default), or recaption / think / think_recaption: "
                                                   "the model writes a CoT before drawing (Instruct flavours)")
    drop_think: bool | None = Field(None, description="leave the <think> section out of the image pass")
    cot_max_tokens: int | None = Field(None, ge=1, le=MAX_TEXT_TOKENS,
                                       description="tokens the CoT may take (default 2048, the official budget)")
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg/webp quality")
    return_timings: bool = Field(False, description="add per-stage seconds to the response")
    step_cache: float | None = Field(None, ge=0.0, le=10.0,
                                     description="TeaCache threshold for this request (0 = off; default: recipe)")


class _ImagesParams(GenerationParams):
    """The fields OpenAI's Images create and edit share."""

    prompt: str
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    response_format: Literal["b64_json", "url"] | None = None
    quality: str | None = None  # accepted for OpenAI compatibility, no effect
    background: Literal["auto", "opaque", "transparent"] | None = None
    moderation: str | None = None  # accepted for OpenAI compatibility, no effect
    user: str | None = None
    stream: bool | None = None


class ImageGenerationRequest(_ImagesParams):
    """``POST /v1/images/generations`` (OpenAI Images create, plus the diffusion extras)."""

    size: str | None = Field(None, description="WIDTHxHEIGHT: the image has exactly this size (generated at the "
                                               "model's nearest native size, then centre-cropped to the aspect and "
                                               "resampled); native or auto: the model's size, untouched")
    style: str | None = None  # accepted for OpenAI compatibility, no effect


class ImageEditRequest(_ImagesParams):
    """``POST /v1/images/edits`` form fields (OpenAI Images edit, plus the diffusion extras); the files are apart.

    Multipart fields arrive as strings: pydantic's lax mode turns "2", "1.5" and "true" into the declared types.
    """

    size: str | None = Field(None, description="WIDTHxHEIGHT: exactly this size; absent: the first image's size; "
                                               "native or auto: the model's snap of the first image, untouched")
    input_fidelity: str | None = None  # accepted for OpenAI compatibility, no effect
    partial_images: int | None = Field(None, ge=0, le=0, description="partial images are not streamed: 0 or absent")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class ChatCompletionRequest(GenerationParams):
    """``POST /v1/chat/completions``: an image (vLLM-Omni's diffusion chat; the default) or, with
    ``modalities: ["text"]``, a text answer (OpenAI chat). Ranges of the text fields are checked in
    text_requests.py, for text answers only: image chat accepts and ignores them, as it always has."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    modalities: list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    size: str | None = None
    height: int | None = Field(None, ge=1)
    width: int | None = Field(None, ge=1)
    num_outputs_per_prompt: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # sampling of a text answer (image chat accepts and ignores them)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None  # refused unless empty: there is no exact mapping to stop tokens
    presence_penalty: float | None = None  # 0 only
    frequency_penalty: float | None = None  # 0 only
    logprobs: bool | None = None  # false only


# ------------------------------------------------------------------ responses (documentation and tests)


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None
    seed: int | None = None
    timings: dict[str, float] | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str  # WxH of the images returned
    native_size: str  # WxH the model generated at, before the fit to ``size``
    timings: dict[str, float] | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
