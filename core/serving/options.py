"""What a deployment configures in the HTTP layer: ``ServingOptions`` and the model's ``ModelHelpers``."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from .encode import PNG_LEVEL
from .limits import MAX_TEXT_TOKENS

FALLBACK_DEFAULTS = SimpleNamespace(steps=50, guidance=5.0, size="1024x1024", shift=3.0, template="pretrain",
                                    system_prompt=None)


@dataclass(frozen=True)
class ModelHelpers:
    """Model-specific answers the API needs: size parsing and snapping, system-prompt modes.

    A model flavour supplies its own (``ModelFlavor.serving_helpers()``);
    ``plain()`` is the model-free default: sizes as asked, prompts as given.
    """

    parse_size: Callable[[str], tuple[int, int]]  # "WxH" -> (height, width); ValueError if malformed
    snap: Callable[[int, int], tuple[int, int]]  # requested (h, w) -> generated (h, w)
    system_prompt: Callable[..., str | None]  # (mode name or text, bot_task="image") -> text
    max_images: int = 0  # reference images a request may carry (0: the model does not edit)
    writes_text: bool = False  # text answers (chat modalities ["text"]) and bot_task think / recaption

    @classmethod
    def plain(cls) -> "ModelHelpers":
        from omni.recipe import parse_size  # "WxH" -> (width, height); RecipeError is a ValueError

        return cls(lambda size: parse_size(size)[::-1], lambda h, w: (h, w), lambda value, bot_task="image": value)


@dataclass(frozen=True)
class ServingOptions:
    model_id: str
    defaults: Any = field(default_factory=lambda: FALLBACK_DEFAULTS)  # a recipe's ``defaults`` section
    api_key: str | None = None
    request_timeout_s: float = 600.0
    max_prompt_chars: int = 8000
    max_queue: int | None = None  # n above this can never be queued: a 400, not a 429
    max_side: int = 4096  # of a requested image; a deployment (or a fuzz run) may cap it lower
    max_steps: int = 200  # num_inference_steps (schemas.MAX_STEPS); may be capped lower the same way
    max_cot_tokens: int = MAX_TEXT_TOKENS  # cot_max_tokens, and the CoT budget of a request that gives none
    helpers: ModelHelpers = field(default_factory=ModelHelpers.plain)
    # reference images (editing): see omni.serving.image_input for the rules
    max_image_pixels: int = 4096 * 4096  # recipe serving.max_image_pixels
    max_image_bytes: int = 20 << 20  # encoded bytes per image (413 past it)
    fetch_remote_images: bool = False  # recipe serving.fetch_remote_images: chat image_url may be http(s)
    fetch_timeout_s: float = 10.0  # per remote image
    png_level: int = PNG_LEVEL  # recipe serving.png_compress_level: zlib level of PNG responses

    @classmethod
    def from_recipe(cls, recipe, *, model_id: str, api_key: str | None = None, **kw) -> "ServingOptions":
        """The options ``recipe.serving`` describes, with its model flavour's helpers (from the registry)."""
        from omni import model_registry

        s = recipe.serving
        kw.setdefault("helpers", model_registry.get(recipe.model.flavor).serving_helpers())
        kw.setdefault("max_image_pixels", s.max_image_pixels)
        kw.setdefault("fetch_remote_images", s.fetch_remote_images)
        kw.setdefault("png_level", s.png_compress_level)
        return cls(model_id=model_id, defaults=recipe.defaults, api_key=api_key,
                   request_timeout_s=s.request_timeout_s, max_queue=s.max_queue + s.max_running, **kw)
