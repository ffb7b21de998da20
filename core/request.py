"""Requests and results that cross the boundary between serving, scheduler and pipeline."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

COT_BUDGET = 2048  # the official max_new_tokens of the CoT pass (ImageRequest.cot_max_tokens by default)


@dataclass(frozen=True, kw_only=True)
class ImageRequest:
    """One image to draw: text-to-image, or an edit of reference ``images`` (``n`` images are ``n`` requests).

    ``images``: the reference (conditioning) images of an editing request,
    each a C-contiguous uint8 numpy array ``[H, W, 3]`` (RGB), in prompt order;
    empty for text-to-image. The serving layer and the CLI decode and check
    them (count, pixels, mode) before a request is built; the model decides
    how many it takes (``ModelHelpers.max_images``).
    """

    prompt: str
    negative_prompt: str | None = None  # None: the official <cfg>-token unconditional row
    height: int = 1024
    width: int = 1024
    steps: int = 50
    guidance: float = 5.0  # <= 1.0 disables CFG (one row per request)
    seed: int | None = None  # None: drawn at admission and reported back
    shift: float = 3.0
    template: str = "pretrain"  # pretrain | instruct
    system_prompt: str | None = None
    cot_text: str | None = None
    step_cache: float | None = None  # TeaCache threshold; None = the recipe's, 0 = off
    return_latents: bool = False  # also hand back the final latents (parity checks, debugging)
    # reference images for editing: uint8 numpy [H, W, 3] RGB arrays, in order (arrays have no ==)
    images: tuple = field(default=(), compare=False)
    bot_task: str = "image"  # image | recaption | think | think_recaption: write a CoT before drawing
    drop_think: bool = False  # leave the <think> section out of the image pass
    auto_size: bool = False  # with a CoT pass: the model picks the aspect ratio (height/width ignored)
    cot_max_tokens: int = COT_BUDGET
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    @property
    def use_cfg(self) -> bool:
        return self.guidance > 1.0


@dataclass(frozen=True, kw_only=True)
class TextRequest:
    """One text answer (T2T, or I2T with ``images``): the model continues the prompt token by token.

    Sampling follows ``temperature`` (0 = greedy), then ``top_k`` and
    ``top_p`` over the tempered distribution; each token's draw is a function
    of ``seed`` and its index only, so a seed gives the same answer alone or
    in any batch. Decoding stops at the model's stop tokens (or ``stop_ids``
    when given) or after ``max_tokens`` tokens.
    """

    prompt: str
    images: tuple = field(default=(), compare=False)  # uint8 numpy [H, W, 3] RGB arrays, as ImageRequest
    system_prompt: str | None = None
    max_tokens: int = 256
    temperature: float = 0.6  # the Instruct generation_config (do_sample, 0.6 / top_k 1024 / top_p 0.95)
    top_k: int = 1024
    top_p: float = 0.95
    seed: int | None = None
    stop_ids: tuple[int, ...] | None = None  # None: the model's own stop tokens
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])


@dataclass
class TextResult:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens)
    seed: int
    times: "StageTimes"


@dataclass
class StageTimes:
    """Wall seconds per stage, measured on the host at stage boundaries."""

    queue: float = 0.0
    conditioning: float = 0.0  # reference images: ViT + VAE encoder + placing them in the prefix
    prefill: float = 0.0
    denoise: float = 0.0
    vae: float = 0.0
    encode: float = 0.0
    steps_skipped: int = 0  # denoising steps served by the step cache

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


@dataclass
class ImageResult:
    request_id: str
    image_HW3: object  # uint8 numpy array, height x width x 3
    seed: int
    height: int
    width: int
    steps: int
    times: StageTimes
    latents: object = None  # fp32 CPU tensor [1, C, h, w] when the request asked for it
    revised_prompt: str | None = None  # the CoT the model wrote before drawing (bot_task other than image)


@dataclass(frozen=True)
class GenerateJob:
    """One ``omni-run generate``: what to draw and where to write it (flags with recipe defaults filled)."""

    request: ImageRequest
    output: Path
    latents: Path | None = None  # also write the final latents here (safetensors)
    output_size: tuple[int, int] | None = None  # (h, w) written; None: the model's native size, untouched
    verbose: bool = False  # also print the native size
