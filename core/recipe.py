"""Recipes: one YAML file = one deployment of one model on one kind of device.

A recipe is loaded once, validated completely and frozen. Every section is a
frozen dataclass (``omni.recipe_schema``); every field carries its
documentation, allowed values and default in ``field(metadata=...)``
(``omni-run recipes --schema`` prints them). Unknown keys, bad values and
wrong types are ``RecipeError``s whose one-line message names the file, the
dotted key and what is allowed::

    recipes/a2_tp4.yaml: parallel.tpp: unknown key 'tpp'; allowed: tp, ep, ulysses, ring, cfg, dp

Data flow (one direction)::

    load_recipe("h200_fp8") -> Recipe (frozen)
        -> Platform.check_recipe(recipe)               refusals with reasons
        -> apply_patches(recipe, Platform.plan_patches(recipe), log)
        -> the final Recipe every worker builds from (picklable)

Where the parts live (none imports torch or model code or reads environment
variables: the CLI passes every outside value in)::

    omni.recipe_fields   RecipeError, value parsers (parse_size, parse_bytes, ...),
                         field metadata and checks, building sections from input
    omni.recipe_schema   the section dataclasses and Recipe
    omni.recipe          (this module) apply_patches, loading, introspection, and
                         the public API: import recipe names from here

A minimal recipe (every section and field is optional except what differs
from the defaults)::

    name: cpu_tiny
    platform: cpu
    device: {kind: cpu}
    model: {flavor: hunyuan_image3_tiny, dtype: float32}
"""
import dataclasses
import os
import typing
from collections.abc import Callable, Iterable
from dataclasses import fields, is_dataclass
from importlib import resources
from pathlib import Path

import yaml

from .recipe_fields import (
    BUILTIN_PLATFORMS,
    PLATFORM_GROUP,
    VALIDATED_REQUIRED,
    FrozenDict,
    RecipeError,
    _build,
    _choices,
    _join,
    _type_name,
    parse_bytes,
    parse_requirement,
    parse_size,
    platform_choices,
    unmet_requirement,
)
from .recipe_schema import (
    ATTENTION_BACKENDS,
    DTYPES,
    GROUPED_FP8,
    GROUPED_SKINNY_ROWS,
    GROUPED_SMALL_ROWS,
    MEMORY_BOUND,
    PDL_ROWS,
    SKINNY_ROWS,
    QUANT_SCHEMES,
    TINY_FLAVOR,
    Attention,
    Defaults,
    Device,
    GiB,
    Graph,
    Kernels,
    KvCache,
    Model,
    Offload,
    Parallel,
    Quant,
    Ray,
    Recipe,
    Serving,
    StepCache,
    Vae,
)

__all__ = [
    "RECIPES_PACKAGE", "PLATFORM_GROUP", "BUILTIN_PLATFORMS", "TINY_FLAVOR", "DTYPES", "QUANT_SCHEMES",
    "ATTENTION_BACKENDS", "MEMORY_BOUND", "GROUPED_FP8", "GROUPED_SMALL_ROWS", "GROUPED_SKINNY_ROWS",
    "SKINNY_ROWS", "PDL_ROWS", "VALIDATED_REQUIRED", "GiB",
    "RecipeError", "parse_size", "parse_bytes", "parse_requirement", "unmet_requirement", "FrozenDict",
    "platform_choices",
    "Device", "Model", "Parallel", "Quant", "Attention", "Kernels", "KvCache", "Offload", "StepCache", "Graph", "Vae",
    "Serving", "Ray", "Defaults", "Recipe",
    "apply_patches", "parse_recipe", "load_recipe", "list_recipes", "field_paths", "schema_rows", "parse_overrides",
]

RECIPES_PACKAGE = "omni.recipes"


# ------------------------------------------------------------------ plan patches


def apply_patches(recipe: Recipe, patches: Iterable, log: Callable[[str], None]) -> Recipe:
    """Apply ``omni.specs.PlanPatch``es in order; ``log`` gets one line per changed field.

    Each patch's ``changes`` (dotted path -> value) is applied atomically and
    validated like recipe input; an invalid patch is a RecipeError naming its reason.
    """
    for patch in patches:
        reason = patch.reason or "no reason given"
        try:
            new = recipe.replace_paths(patch.changes)
        except RecipeError as e:
            raise RecipeError(f"plan patch ({reason}) is invalid: {e}") from None
        for path in patch.changes:
            old, value = recipe.get_path(path), new.get_path(path)
            if old != value:
                log(f"plan patch: {path}: {old!r} -> {value!r} ({reason})")
        recipe = new
    return recipe


def parse_overrides(items: Iterable[str], flag: str = "--set") -> dict:
    """``KEY=VALUE`` command-line overrides as ``{dotted key: YAML value}`` (``prepare(overrides=...)`` checks
    the keys and values); an item without ``=`` is a RecipeError naming ``flag``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


# ------------------------------------------------------------------ loading


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (plain PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader reports unhashable keys itself
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml_error(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"invalid YAML{where}: {getattr(e, 'problem', None) or e}"


def parse_recipe(text: str, source: str = "<string>", default_name: str = "") -> Recipe:
    """Parse and validate recipe YAML; ``name`` defaults to ``default_name`` (the file stem)."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise RecipeError(_yaml_error(e), source=source) from None
    if data is None:
        raise RecipeError("empty recipe; expected a mapping (see omni-run recipes --schema)", source=source)
    if isinstance(data, dict) and "name" not in data and default_name:
        data = {"name": default_name, **data}
    try:
        return _build(Recipe, data)
    except RecipeError as e:
        raise e.within(source=source) from None


def _locate(ref: "str | os.PathLike[str]"):
    """A path (has a '/' or ends in .yaml/.yml) or a packaged recipe name."""
    text = os.fspath(ref)
    if isinstance(ref, os.PathLike) or text.endswith((".yaml", ".yml")) or "/" in text or os.sep in text:
        return Path(text)
    packaged = resources.files(RECIPES_PACKAGE) / f"{text}.yaml"
    if not packaged.is_file():
        raise RecipeError(f"unknown recipe {text!r}; packaged recipes: {', '.join(list_recipes()) or 'none'} "
                          "(or pass a path to a .yaml file)")
    return packaged


def load_recipe(path_or_name: "str | os.PathLike[str]") -> Recipe:
    """Load a packaged recipe by name (``"cpu_tiny"``) or a YAML file by path."""
    where = _locate(path_or_name)
    try:
        text = where.read_text(encoding="utf-8")
    except OSError as e:
        raise RecipeError(f"cannot read ({e.strerror or e})", source=str(where)) from None
    return parse_recipe(text, source=str(where), default_name=Path(where.name).stem)


def list_recipes() -> list[str]:
    """Names of the packaged recipes (``recipes/*.yaml``), sorted."""
    return sorted(p.name[: -len(".yaml")] for p in resources.files(RECIPES_PACKAGE).iterdir()
                  if p.name.endswith(".yaml"))


# ------------------------------------------------------------------ introspection (docs, --schema, surface test)


def field_paths(cls=Recipe, prefix: str = "") -> list[str]:
    """Every leaf of the schema as a dotted path, in declaration order."""
    out = []
    for f in fields(cls):
        path = _join(prefix, f.name)
        out += field_paths(f.type, path) if is_dataclass(f.type) else [path]
    return out


def schema_rows(cls=Recipe, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """``(path, allowed, default, doc)`` for every leaf: the recipe reference."""
    rows = []
    for f in fields(cls):
        path = _join(prefix, f.name)
        if is_dataclass(f.type):
            rows += schema_rows(f.type, path)
            continue
        choices, rule = _choices(f), f.metadata.get("rule")
        allowed = " | ".join(map(str, choices)) if choices else _type_name(f.type)
        allowed += f" ({rule.text})" if rule and not choices else ""
        default = "(required)" if f.default is dataclasses.MISSING else yaml.safe_dump(
            list(f.default) if isinstance(f.default, tuple) else f.default, default_flow_style=True).strip()
        rows.append((path, allowed, default.removesuffix("\n...").strip(), f.metadata["doc"]))
    return rows
