"""The HunyuanImage-3.0 flavours, registered under ``omni.models`` (pyproject.toml) as a third party would.

    hunyuan_image3                  the base checkpoint: text-to-image, pretrain template
    hunyuan_image3_instruct         HunyuanImage-3.0-Instruct (same parameter names; editing, text, CoT)
    hunyuan_image3_instruct_distil  HunyuanImage-3.0-Instruct-Distil (CFG-distilled 8-step meanflow)
    hunyuan_image3_tiny             the embedded tiny checkpoint of the base architecture, trained to draw
                                    coloured shapes at 128x128 (no download; assets/tiny_trained/README.md)
    hunyuan_image3_tiny_random      the same architecture with random weights, generated (code-path tests)
    hunyuan_image3_instruct_tiny    the embedded tiny Instruct checkpoint, trained from the tiny default on
                                    edit pairs at 256x256 (assets/tiny_instruct_trained/README.md)
    hunyuan_image3_instruct_tiny_random  the tiny Instruct architecture with random weights (code-path tests)

Which checkpoint is which is read from config.json: the Distil flags
``cfg_distilled`` and ``use_meanflow``; the Instruct release writes
``model_version: HunyuanImage-3.0-Instruct`` (the base config has no
Instruct version string). The shapes are the same for all three.
"""
from __future__ import annotations

from dataclasses import dataclass


def _is_distil(config: dict) -> bool:
    return bool(config.get("cfg_distilled")) and bool(config.get("use_meanflow"))


def _is_instruct(config: dict) -> bool:
    return "instruct" in str(config.get("model_version", "")).lower()


MAX_REFERENCE_IMAGES = 3  # the Instruct release edits with up to 3 reference images


@dataclass(frozen=True)
class HunyuanImage3Flavor:
    name: str
    description: str
    needs_weights: bool = True
    missing: str | None = None  # why this version cannot build it yet
    instruct: bool = False  # Instruct size rule, instruct template, reference images
    distil: bool = False  # CFG-distilled: guidance enters as a token, one row per request
    base_size: int = 1024  # image_base_size of its checkpoints (the ratio table of the size rule)

    def unavailable(self) -> str | None:
        return self.missing

    def claims(self, config: dict) -> bool:
        if not self.needs_weights:
            return False  # the embedded checkpoint is chosen by name, never detected
        kind = "distil" if _is_distil(config) else "instruct" if _is_instruct(config) else "base"
        return kind == {"hunyuan_image3": "base", "hunyuan_image3_instruct": "instruct",
                        "hunyuan_image3_instruct_distil": "distil"}[self.name]

    def build_pipeline(self, recipe, platform, *, local_rank: int = 0, parallel=None, progress: bool = True,
                       random_layers: int = 0):
        from .build import build_pipeline

        return build_pipeline(recipe, platform, local_rank=local_rank, parallel=parallel, progress=progress,
                              random_layers=random_layers)

    def serving_helpers(self):
        from omni.recipe import parse_size  # "WxH" -> (width, height); RecipeError is a ValueError
        from omni.serving.options import ModelHelpers

        from . import resolution, system_prompts

        modes = {"None", "dynamic", "custom", *system_prompts.SYSTEM_PROMPTS}

        def system_prompt(value: str | None, bot_task: str = "image") -> str | None:
            if value is None or value not in modes:
                return value  # None, or the text itself
            return system_prompts.resolve_system_prompt(value, bot_task=bot_task)

        if self.instruct:
            return ModelHelpers(lambda size: parse_size(size)[::-1],
                                lambda h, w: resolution.instruct_size((h, w), self.base_size)[:2], system_prompt,
                                max_images=MAX_REFERENCE_IMAGES, writes_text=True)
        return ModelHelpers(lambda size: parse_size(size)[::-1],
                            lambda h, w: resolution.snap(h, w, base=self.base_size)[1:], system_prompt)

    def recipe_problems(self, recipe) -> list[str]:
        """A CFG-distilled checkpoint has no unconditional row: nothing for cfg parallel to split."""
        if self.distil and recipe.parallel.cfg > 1:
            return [f"parallel.cfg={recipe.parallel.cfg} splits the CFG rows over rank groups, but {self.name} "
                    "draws with one row per request (guidance is a token); set parallel.cfg: 1"]
        return []

    def released_config(self):
        if not self.needs_weights:
            return None  # the tiny model is a few MB: nothing to estimate
        from .config import HunyuanImage3Config

        return HunyuanImage3Config.released()

    def parallel_plans(self) -> tuple[dict, dict]:
        from .parallel import SP_PLAN, TP_PLAN

        return TP_PLAN, SP_PLAN


base = HunyuanImage3Flavor("hunyuan_image3", "HunyuanImage-3.0 base checkpoint (80B MoE): text-to-image")
instruct = HunyuanImage3Flavor(
    "hunyuan_image3_instruct", "HunyuanImage-3.0-Instruct: text-to-image and editing with up to 3 reference "
    "images (instruct template)", instruct=True)
instruct_distil = HunyuanImage3Flavor(
    "hunyuan_image3_instruct_distil", "HunyuanImage-3.0-Instruct-Distil: CFG-distilled 8-step meanflow (one "
    "forward per step; editing and text as Instruct)", instruct=True, distil=True)
tiny = HunyuanImage3Flavor("hunyuan_image3_tiny", "embedded tiny checkpoint of the base architecture, trained "
                           "to draw coloured shapes at 128x128 (CPU, no download)", needs_weights=False, base_size=128)
tiny_random = HunyuanImage3Flavor("hunyuan_image3_tiny_random", "the tiny base architecture with random weights "
                                  "(generated; noise images, for code-path tests)", needs_weights=False)
instruct_tiny = HunyuanImage3Flavor(
    "hunyuan_image3_instruct_tiny", "embedded tiny Instruct checkpoint trained to edit coloured shapes "
    "(colour, background, position) at 256x256 (CPU, no download)", needs_weights=False, instruct=True, base_size=256)
instruct_tiny_random = HunyuanImage3Flavor(
    "hunyuan_image3_instruct_tiny_random", "the tiny Instruct architecture with random weights (generated; "
    "image_base_size 256, for code-path tests)", needs_weights=False, instruct=True, base_size=256)
