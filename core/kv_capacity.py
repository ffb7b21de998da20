"""Does the KV budget hold ``serving.max_running`` default requests? A recipe check, two ways.

A recipe whose ``max_running`` the pool cannot hold promises concurrency it
never delivers: the extra requests wait for pages however idle the batch
looks. The unit is one *default request*: ``defaults.size`` and
``defaults.guidance`` (two CFG rows above 1, split over ``parallel.cfg``;
one row for a CFG-distilled flavour) with a typical prompt.

- ``pipeline_problem``: exact, from a built pipeline (its ``pages_needed``
  and its pool): the embedded CPU recipes are checked this way.
- ``static_problem``: arithmetic for any recipe whose flavour has a released
  config (``omni.memory_estimate``): the model's snapped size at 16 px per
  token, plus ``PROMPT_TOKENS`` per row for the template and the prompt.

Either returns the reason (naming ``serving.max_running`` and the budget) or None.
"""
from __future__ import annotations

from .recipe import Recipe, parse_size
from .request import ImageRequest

PROMPT_TOKENS = 128  # template, system prompt and a typical user prompt, per row
PIXELS_PER_TOKEN_SIDE = 16  # HunyuanImage-3: VAE factor 16, patch size 1
TYPICAL_PROMPT = ("a red fox sitting in fresh snow at the edge of a pine forest, morning light, soft shadows, "
                  "detailed fur, calm winter mood")


def default_request(recipe: Recipe) -> ImageRequest:
    width, height = parse_size(recipe.defaults.size)
    d = recipe.defaults
    return ImageRequest(prompt=TYPICAL_PROMPT, height=height, width=width, steps=d.steps, guidance=d.guidance,
                        shift=d.shift, template=d.template, request_id="kv-capacity")


def capacity_problem(recipe: Recipe, pages_per_request: int, pool_pages: int) -> str | None:
    holds = pool_pages // max(1, pages_per_request)
    if holds >= recipe.serving.max_running:
        return None
    return (f"serving.max_running={recipe.serving.max_running} but kv_cache.budget_bytes holds {holds} default "
            f"request(s) ({recipe.defaults.size}, guidance {recipe.defaults.guidance:g}: {pages_per_request} pages of "
            f"{recipe.kv_cache.page_tokens} tokens each, the pool has {pool_pages}); lower serving.max_running to "
            f"{holds} or raise kv_cache.budget_bytes")


def pipeline_problem(recipe: Recipe, pipeline) -> str | None:
    """Exact: the built pipeline's own price of a default request against its own pool."""
    return capacity_problem(recipe, pipeline.pages_needed(default_request(recipe)), pipeline.pool.num_pages)


def static_problem(recipe: Recipe) -> str | None:
    """Arithmetic on the flavour's released config; None also when the flavour has none (the tiny ones)."""
    from . import model_registry
    from .memory_estimate import kv_token_bytes, released_config

    cfg = released_config(recipe.model.flavor)
    if cfg is None:
        return None
    width, height = parse_size(recipe.defaults.size)
    h, w = model_registry.get(recipe.model.flavor).serving_helpers().snap(height, width)
    row = PROMPT_TOKENS + 2 + (h // PIXELS_PER_TOKEN_SIDE) * (w // PIXELS_PER_TOKEN_SIDE)
    cfg_rows = 1 if "distil" in recipe.model.flavor or recipe.defaults.guidance <= 1 else 2
    rows_here = -(-cfg_rows // recipe.parallel.cfg)
    page = recipe.kv_cache.page_tokens
    pool_pages = recipe.kv_cache.budget_bytes // (page * kv_token_bytes(recipe, cfg))
    return capacity_problem(recipe, rows_here * -(-row // page), pool_pages)
