"""What a deployment configures in the HTTP layer: ``ServingOptions`` and the model's ``ModelHelpers``."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

FALLBACK_DEFAULTS = SimpleNamespace(steps=50, guidance=5.0, size="1024x1024", shift=3.0, template="pretrain",
                                    system_prompt=None)


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
