"""One way to assemble a deployment: recipe and platform once, into a frozen ``Deployment``.

    prepare("h200_fp8", platform="cuda", overrides={"model.path": "/ckpt/HI3"})
        load_recipe -> overrides -> requires check -> model flavour (``auto`` read from config.json)
        -> select the platform (--platform, else the recipe's, auto = detect)
        -> Platform.check_recipe + device checks -> plan patches
        -> Deployment(recipe)     frozen, picklable; recipe.platform and recipe.model.flavor concrete

``omni-run generate``, ``serve`` and ``bench``, the launcher's workers and the
bench/ scripts start from it; workers receive the Deployment itself (never a
recipe name to load again), so the checked and patched recipe is the one
every rank builds. In each process ``platform()`` selects the plugin once and
``flavor()`` loads the model flavour from the registry; ``open_engine()``
returns the one engine handle the callers use, in this process (world size
1) or over launched ranks (world size > 1).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from . import model_registry
from .recipe import GiB, Recipe, RecipeError, apply_patches, load_recipe, unmet_requirement

log = logging.getLogger("omni.deployment")
_PLATFORMS: dict[tuple[str, bool], object] = {}  # one selected Platform per process and name


class DeploymentError(ValueError):
    """The recipe cannot be deployed as asked (exit status 2); the message names the field or flag."""


@dataclass(frozen=True)
class Deployment:
    """A final recipe plus how to log; everything a process needs to build and run it."""

    recipe: Recipe
    trace: bool = False

    @property
    def world_size(self) -> int:
        return self.recipe.parallel.world_size

    @property
    def model_id(self) -> str:
        """The id /v1/models reports: the checkpoint directory's name, else the flavour."""
        path = self.recipe.model.path
        return Path(path).name if path else self.recipe.model.flavor

    def platform(self):
        """This process's ``Platform`` for ``recipe.platform`` (selected once per process)."""
        from .platform_manager import select

        key = (self.recipe.platform, self.trace)
        if key not in _PLATFORMS:
            _PLATFORMS[key] = select(self.recipe.platform, trace=self.trace)
        return _PLATFORMS[key]

    def flavor(self) -> model_registry.ModelFlavor:
        return model_registry.get(self.recipe.model.flavor)

    def build_pipeline(self, *, platform=None, local_rank: int = 0, parallel=None, progress: bool = True,
                       random_layers: int = 0):
        """The model's pipeline for one worker (``platform``: the worker's own, default this process's);
        ``random_layers``: the released shapes with random values (benchmarks, ``ModelFlavor.build_pipeline``)."""
        return self.flavor().build_pipeline(self.recipe, platform or self.platform(), local_rank=local_rank,
                                            parallel=parallel, progress=progress, random_layers=random_layers)

    def open_engine(self, *, progress: bool = False, warm_up: bool = False, random_layers: int = 0,
                    compile_ahead: tuple = ()):
        """The engine handle (not started): a local engine loop, or the router over launched replicas;
        ``warm_up``: the server's warm-up requests run before it is ready (``serving.warmup_steps``);
        ``random_layers``: released shapes, random values; ``compile_ahead``: requests only the compile pass
        runs (``omni.engine_handle.open_engine``)."""
        from .engine_handle import open_engine

        return open_engine(self, progress=progress, warm_up=warm_up, random_layers=random_layers,
                           compile_ahead=compile_ahead)


@dataclass(frozen=True)
class Endpoint:
    """Where and how ``serve`` listens: resolved by the CLI from flags, the recipe and the environment."""

    host: str
    port: int
    api_key: str | None = None


# ------------------------------------------------------------------ preparing


def prepare(recipe: str | os.PathLike | Recipe, *, platform: str | None = None,
            overrides: Mapping[str, object] | None = None, trace: bool = False,
            random_weights: bool = False) -> Deployment:
    """Load, override, check and patch ``recipe`` for ``platform`` (default: the recipe's); see the module doc.

    ``random_weights``: the caller builds the flavour's shapes with random
    weights (bench/), so a flavour that needs a checkpoint may have none.
    """
    r = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    if platform and r.platform not in ("auto", platform):
        raise DeploymentError(f"recipe {r.name} is for platform {r.platform}; --platform {platform} conflicts "
                              f"(choose a recipe for {platform}, or one with platform: auto)")
    r = _with_overrides(r, dict(overrides or {}))
    unmet = unmet_requirement(r.requires)
    if unmet:
        raise DeploymentError(f"recipe {r.name} {unmet}")
    r = _resolve_flavor(r, random_weights)
    if r.model.path is not None and not random_weights:
        _check_weights(r)
    from .platform_manager import select

    chosen = select(platform or r.platform, trace=trace)
    r = check_on(r, chosen)
    _PLATFORMS[(chosen.name, trace)] = chosen
    _log_summary(r)
    return Deployment(r, trace=trace)


def _with_overrides(recipe: Recipe, overrides: dict) -> Recipe:
    path = overrides.get("model.path")
    if path is not None:
        if not os.path.isdir(path):
            raise DeploymentError(f"model path {path!r} is not a directory")
        overrides["model.path"] = os.path.abspath(path)
    return recipe.replace_paths(overrides) if overrides else recipe


def _resolve_flavor(recipe: Recipe, random_weights: bool = False) -> Recipe:
    """``model.flavor`` made concrete and checked against the registry and the checkpoint."""
    m = recipe.model
    try:
        if m.flavor != model_registry.AUTO:
            model_registry.get(m.flavor)  # not buildable: that is the reason to give, before any checkpoint check
        name = model_registry.resolve(m.flavor, m.path)
        flavor = model_registry.get(name)
    except model_registry.ModelError as e:
        raise DeploymentError(f"recipe {recipe.name}: {e}") from None
    if flavor.needs_weights and m.path is None and not random_weights:
        raise DeploymentError(f"recipe {recipe.name} runs {name}, which needs its weights: pass --model PATH "
                              "(a Hugging Face-format directory with safetensors)")
    problems = getattr(flavor, "recipe_problems", lambda r: [])(recipe)
    if problems:
        raise DeploymentError(f"recipe {recipe.name} with model flavor {name}: " + "; ".join(problems))
    return recipe if name == m.flavor else recipe.replace_path("model.flavor", name)


def _check_weights(recipe: Recipe) -> None:
    """The checkpoint at ``model.path`` has its safetensors, every shard its index names (an interrupted download
    is refused here, naming what is missing, before any worker starts loading)."""
    from .weights import CheckpointError, checkpoint_files

    try:
        checkpoint_files(recipe.model.path)
    except CheckpointError as e:
        raise DeploymentError(f"recipe {recipe.name}: model.path {e}") from None


def check_on(recipe: Recipe, platform) -> Recipe:
    """Resolve ``platform: auto``, run the platform's checks, apply its plan patches."""
    if recipe.platform != platform.name:
        recipe = recipe.replace_path("platform", platform.name)
    reasons = platform.check_recipe(recipe) + device_problems(recipe, platform.info)
    if reasons:
        raise DeploymentError(f"platform {platform.name} refuses recipe {recipe.name}: " + "; ".join(reasons))
    return apply_patches(recipe, platform.plan_patches(recipe), log.info)


def device_problems(recipe: Recipe, info) -> list[str]:
    """Host-side checks that need no vendor knowledge (the CPU reference has no device limits)."""
    if not info.accelerator:
        return []
    problems = []
    if info.device_count < recipe.device.count:
        p = recipe.parallel
        degrees = ", ".join(f"{k} {getattr(p, k)}" for k in ("dp", "cfg", "ulysses", "ring", "tp") if getattr(p, k) > 1)
        problems.append(f"device.count={recipe.device.count} (parallel: {degrees or 'none'}) but {info.name} sees "
                        f"{info.device_count} device(s): one process per device")
    have, need = info.memory_bytes / GiB, recipe.device.memory_gib
    if info.memory_bytes and have < need:
        problems.append(f"device.memory_gib={need:g} but each {info.device_name or info.name} has {have:.1f} GiB")
    return problems


def one_replica(deployment: Deployment) -> Deployment:
    """The deployment with ``dp`` 1: one request needs one replica, whatever the recipe serves with."""
    p = deployment.recipe.parallel
    if p.dp == 1:
        return deployment
    log.info("one request needs one replica: launching dp 1 of %d (%d ranks)", p.dp, p.world_size // p.dp)
    recipe = deployment.recipe.replace_paths({"parallel.dp": 1, "device.count": p.world_size // p.dp})
    return Deployment(recipe, trace=deployment.trace)


def _log_summary(r: Recipe) -> None:
    p = r.parallel
    log.info("recipe %s on %s: %d x %s, world %d (dp %d cfg %d ulysses %d ring %d tp %d ep %d), %s, quant %s, "
             "model %s", r.name, r.platform, r.device.count, r.device.kind, p.world_size, p.dp, p.cfg, p.ulysses,
             p.ring, p.tp, p.ep, r.model.dtype, r.quant.scheme, r.model.flavor)


__all__ = [
    "Deployment", "DeploymentError", "Endpoint", "RecipeError", "check_on", "device_problems", "one_replica", "prepare",
]
