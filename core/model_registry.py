"""The model registry: model flavours found through the ``omni.models`` entry-point group.

A model package registers each flavour it implements exactly as a platform
registers itself (``omni.platforms``); the built-in HunyuanImage-3.0
flavours do it in pyproject.toml like a third party would::

    [project.entry-points."omni.models"]
    hunyuan_image3 = "omni.models.hunyuan_image3.flavors:base"

Core never imports a model package: it loads the entry point a recipe's
``model.flavor`` names and talks to the object through ``ModelFlavor``.
``model.flavor: auto`` is resolved here from the checkpoint's config.json
(every flavour that needs weights is asked whether it ``claims`` it; exactly
one must). A flavour whose import fails is reported with its error and
breaks nothing else (``omni-run models`` lists it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from .installed_entry_points import of_group

ENTRY_POINT_GROUP = "omni.models"
AUTO = "auto"


class ModelError(ValueError):
    """A flavour that is unknown, not implemented yet, broken, or at odds with its checkpoint."""


@runtime_checkable
class ModelFlavor(Protocol):
    """What core asks of one model flavour (one entry point of ``omni.models``).

    ``name`` is the entry-point name (the recipe's ``model.flavor``).
    ``description``: one line for ``omni-run models``.
    ``needs_weights``: False for a flavour that ships or generates its own
    checkpoint (the embedded tiny model); True where ``model.path`` is needed.
    """

    name: str
    description: str
    needs_weights: bool

    def unavailable(self) -> str | None:
        """Why this flavour cannot be built in this version (None: it can); shown as the refusal."""

    def claims(self, config: dict) -> bool:
        """Whether a checkpoint's parsed config.json is this flavour (used to resolve ``auto``)."""

    def build_pipeline(self, recipe, platform, *, local_rank: int = 0, parallel=None, progress: bool = True,
                       random_layers: int = 0):
        """The pipeline one worker runs (the scheduler's pipeline protocol) for a final recipe.

        Called once per worker, on the engine thread; ``parallel`` is the
        worker's ``omni.parallel.runtime.ParallelRuntime`` under a mesh.
        ``random_layers`` > 0 (``omni-run bench --full-size-layers``): the
        released shapes with that many decoder layers and random values, built
        exactly as a checkpoint is (a flavour without such a build raises ValueError).
        """

    def serving_helpers(self):
        """The ``omni.serving.options.ModelHelpers`` the HTTP layer uses (size parsing and snapping, system prompts)."""

    def recipe_problems(self, recipe) -> list[str]:
        """Recipe settings this flavour cannot run with, each naming the field (checked by ``prepare``)."""

    def released_config(self):
        """The released checkpoint's config object for memory estimates and docs (None: not estimated)."""

    def parallel_plans(self) -> tuple[dict, dict]:
        """(tensor/expert-parallel plan, sequence-parallel plan): module glob -> style, for docs."""


@dataclass(frozen=True)
class Registered:
    """One ``omni.models`` entry point: its flavour object, or why it could not be loaded."""

    name: str
    flavor: ModelFlavor | None
    error: str | None = None


def names() -> tuple[str, ...]:
    """Registered flavour names, from package metadata only (nothing is imported)."""
    return tuple(sorted({ep.name for ep in of_group(ENTRY_POINT_GROUP)}))


def flavor_choices() -> tuple[str, ...]:
    """What ``model.flavor`` may say: ``auto`` or a registered flavour."""
    return (AUTO, *names())


def discover() -> list[Registered]:
    """Every registered flavour, loaded; a failing import is recorded, not raised."""
    return [_load(ep) for ep in sorted(of_group(ENTRY_POINT_GROUP), key=lambda e: e.name)]


def _load(ep) -> Registered:
    try:
        obj = ep.load()
    except Exception as e:  # noqa: BLE001 - a broken model package must not break the others
        return Registered(ep.name, None, f"import failed: {type(e).__name__}: {e}")
    if not isinstance(obj, ModelFlavor):
        return Registered(ep.name, None, f"{ep.value} is not a ModelFlavor (see omni.model_registry)")
    return Registered(ep.name, obj)


def entry(name: str) -> ModelFlavor:
    """The registered flavour ``name``, built or not yet buildable (docs and estimates describe both)."""
    found = {r.name: r for r in discover()}
    if name not in found:
        raise ModelError(f"unknown model flavor {name!r}; registered: {', '.join(found) or 'none'}")
    if found[name].flavor is None:
        raise ModelError(f"model flavor {name!r} cannot be loaded: {found[name].error}")
    return found[name].flavor


def get(name: str) -> ModelFlavor:
    """The usable flavour ``name``; ModelError naming the reason otherwise."""
    flavor = entry(name)
    reason = flavor.unavailable()
    if reason:
        raise ModelError(f"model flavor {name!r} is not available: {reason}")
    return flavor


def read_config(model_path: str | Path) -> dict:
    """The checkpoint's config.json as a dict; ModelError naming the file when it is absent or invalid."""
    path = Path(model_path) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelError(f"{path}: cannot read the checkpoint config ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None


def claimants(config: dict) -> list[str]:
    """Flavours that need weights and claim ``config`` (the embedded tiny flavour never does)."""
    return [r.name for r in discover()
            if r.flavor is not None and r.flavor.needs_weights and r.flavor.claims(config)]


def resolve(flavor: str, model_path: str | None) -> str:
    """The concrete flavour for a recipe's ``model.flavor`` and ``model.path``.

    ``auto`` reads the checkpoint's config.json; an explicit flavour that
    needs weights is checked against it, so a base recipe pointed at an
    Instruct checkpoint is refused instead of running it wrong.
    """
    if flavor == AUTO and model_path is None:
        raise ModelError("model.flavor=auto reads the checkpoint's config.json: pass --model PATH (or set "
                         "model.path), or name the flavor")
    if model_path is None or (flavor != AUTO and not entry(flavor).needs_weights):
        return flavor  # the embedded flavour takes a directory of its own kind: nothing to detect
    config_path, claimed = Path(model_path) / "config.json", claimants(read_config(model_path))
    if flavor == AUTO:
        if len(claimed) != 1:
            raise ModelError(f"{config_path}: model.flavor=auto found "
                             + (f"several flavors claiming it ({', '.join(claimed)})" if claimed else
                                "no registered flavor that claims it") + "; set model.flavor")
        return claimed[0]
    if claimed and flavor not in claimed:
        raise ModelError(f"model.flavor={flavor} but {config_path} describes {', '.join(claimed)}; "
                         f"set model.flavor to {claimed[0]} or auto")
    return flavor
