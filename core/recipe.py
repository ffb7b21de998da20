"""Recipes: one YAML file = one deployment of one model on one kind of device.

A recipe is loaded once, validated completely and frozen. Every section is a
frozen dataclass below; every field carries its documentation, allowed values
and default in ``field(metadata=...)`` (``omni-run recipes --schema`` prints
them). Unknown keys, bad values and wrong types are ``RecipeError``s whose
one-line message names the file, the dotted key and what is allowed::

    recipes/a2_tp4.yaml: parallel.tpp: unknown key 'tpp'; allowed: tp, ep, ulysses, ring, cfg, dp

Data flow (one direction)::

    load_recipe("h200_fp8") -> Recipe (frozen)
        -> Platform.check_recipe(recipe)               refusals with reasons
        -> apply_patches(recipe, Platform.plan_patches(recipe), log)
        -> the final Recipe every worker builds from (picklable)

This module imports neither torch nor model code and reads no environment
variables: the CLI passes every outside value in.

A minimal recipe (every section and field is optional except what differs
from the defaults)::

    name: cpu_tiny
    platform: cpu
    device: {kind: cpu}
    model: {flavor: hunyuan_image3_tiny, dtype: float32}
"""
import dataclasses
import datetime
import functools
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from decimal import Decimal
from importlib import resources
from importlib.metadata import PackageNotFoundError, entry_points, version as installed_version
from pathlib import Path

import yaml

RECIPES_PACKAGE = "omni.recipes"
PLATFORM_GROUP = "omni.platforms"
BUILTIN_PLATFORMS = ("cpu", "cuda", "rocm", "npu", "xpu", "musa")
FLAVORS = ("hunyuan_image3", "hunyuan_image3_tiny")
TINY_FLAVOR = "hunyuan_image3_tiny"  # the only flavor that runs without --model (embedded weights)
DTYPES = ("float32", "bfloat16", "float16")
QUANT_SCHEMES = ("none", "fp8_tensor", "fp8_row", "mxfp8", "nvfp4", "w8a8")  # == omni.specs.QUANT_SCHEMES (tested)
ATTENTION_BACKENDS = ("auto", "sdpa", "varlen", "fa3", "flex", "fia", "aiter")
VALIDATED_REQUIRED = ("date", "hardware", "commit")
GiB = 1 << 30


class RecipeError(ValueError):
    """An invalid recipe (or override, or plan patch); the message is one line.

    ``source`` is the file (or ``recipe NAME``), ``key`` the dotted path,
    ``detail`` what is wrong and what is allowed.
    """

    def __init__(self, detail: str, key: str = "", source: str = ""):
        self.detail, self.key, self.source = " ".join(str(detail).split()), key, source
        super().__init__(": ".join(p for p in (source, key, self.detail) if p))

    def within(self, prefix: str = "", source: str = "") -> "RecipeError":
        """The same error seen from a parent section (``prefix``) or a file (``source``)."""
        return RecipeError(self.detail, _join(prefix, self.key), source or self.source)


def _join(prefix: str, key: str) -> str:
    return ".".join(p for p in (prefix, key) if p)


# ------------------------------------------------------------------ value parsers (no model code)


_SIZE = re.compile(r"\s*(\d+)\s*[xX]\s*(\d+)\s*")
_BYTES = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?[iI]?[bB])?\s*")
_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> tuple[int, int]:
    """``"1024x768"`` -> ``(1024, 768)`` (width, height); raises RecipeError."""
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if not m or not int(m[1]) or not int(m[2]):
        raise RecipeError(f"expected WIDTHxHEIGHT with positive integers (e.g. 1024x1024), got {text!r}")
    return int(m[1]), int(m[2])


def parse_bytes(value: object) -> int:
    """An int, or a string like ``"2GiB"``, ``"512 MiB"``, ``"1.5GB"`` -> bytes.

    Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024);
    a bare number is bytes. The result must be a whole number of bytes.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _BYTES.fullmatch(value) if isinstance(value, str) else None
    unit = (m[2] or "B").upper() if m else ""
    if not m or unit not in _BYTE_UNITS:
        raise RecipeError(f"expected bytes as an integer or a string like '2GiB' or '512MiB' "
                          f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}")
    total = Decimal(m[1]) * _BYTE_UNITS[unit]
    if total != total.to_integral_value():
        raise RecipeError(f"{value!r} is not a whole number of bytes")
    return int(total)


_REQ_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)")
_REQ_SPEC = re.compile(r"\s*(==|!=|>=|<=|~=|>|<)\s*(\d+(?:\.\d+)*)\s*")
_Version = tuple[int, ...]


def parse_requirement(text: str) -> tuple[str, list[tuple[str, _Version]]]:
    """``"omni-run>=0.1,<0.3"`` -> ``("omni-run", [(">=", (0, 1)), ("<", (0, 3))])``.

    A deliberately small subset of PEP 440: release numbers only, operators
    == != >= <= > < ~=, comma separated; "" means no requirement.
    """
    m = _REQ_NAME.fullmatch(text) if isinstance(text, str) else None
    specs = [_REQ_SPEC.fullmatch(part) for part in m[2].split(",")] if m and m[2].strip() else []
    if not m or not all(specs) or any(s[1] == "~=" and "." not in s[2] for s in specs):
        raise RecipeError(f"expected a package requirement like 'omni-run>=0.1' or 'omni-run>=0.1,<0.3', got {text!r}")
    return m[1], [(s[1], tuple(int(x) for x in s[2].split("."))) for s in specs]


def _satisfies(have: _Version, op: str, want: _Version) -> bool:
    n = max(len(have), len(want))
    a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
    if op == "~=":
        return a >= b and have[: len(want) - 1] == want[:-1]
    return {"==": a == b, "!=": a != b, ">=": a >= b, "<=": a <= b, ">": a > b, "<": a < b}[op]


def unmet_requirement(text: str) -> str | None:
    """Why the installed packages do not satisfy ``requires`` (None when they do or it is empty)."""
    if not text:
        return None
    name, specs = parse_requirement(text)
    try:
        found = installed_version(name)
    except PackageNotFoundError:
        return f"requires {text!r} but {name} is not installed"
    m = re.match(r"\d+(?:\.\d+)*", found)
    if not m:
        return f"requires {text!r} but the installed {name} has an unreadable version {found!r}"
    release = tuple(int(x) for x in m[0].split("."))
    bad = [f"{op}{'.'.join(map(str, v))}" for op, v in specs if not _satisfies(release, op, v)]
    return f"requires {text!r} but {name} {found} is installed" if bad else None


def _parse_float(value: object) -> object:
    """YAML 1.1 reads ``1e-3`` as a string; accept numeric strings for float fields."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


# ------------------------------------------------------------------ the validated results block


class FrozenDict(Mapping):
    """A read-only, hashable, picklable mapping (entries of ``validated``)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | Iterable = ()):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"


def _validated_entry(index: int, entry: object) -> FrozenDict:
    if not isinstance(entry, Mapping):
        raise RecipeError(f"entry {index}: expected a mapping like "
                          "{date: 2025-10-02, hardware: 1x H200, commit: abc1234, images_per_min: 3.1}")
    missing = [k for k in VALIDATED_REQUIRED if k not in entry]
    if missing:
        raise RecipeError(f"entry {index}: missing {', '.join(missing)} (required: {', '.join(VALIDATED_REQUIRED)})")
    out = {}
    for key, value in entry.items():
        value = value.isoformat() if isinstance(value, datetime.date) else value
        if not isinstance(key, str) or not isinstance(value, (str, int, float, bool)):
            raise RecipeError(f"entry {index}: {key!r} must map a name to a string or number, got {value!r}")
        out[key] = value
    return FrozenDict(out)


def _parse_validated(value: object) -> object:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise RecipeError(f"expected a list of result entries ({', '.join(VALIDATED_REQUIRED)}, "
                          f"then metric: value pairs), got {_show(value)}")
    return tuple(_validated_entry(i, e) for i, e in enumerate(value))


# ------------------------------------------------------------------ field metadata and checks


@dataclass(frozen=True, slots=True)
class _Rule:
    text: str  # "must be <text>"
    ok: Callable[[object], bool]


def _at_least(n: int) -> _Rule:
    return _Rule(f">= {n}", lambda v: v >= n)


def _pattern(regex: str, text: str) -> _Rule:
    return _Rule(text, lambda v: v is None or re.fullmatch(regex, v) is not None)


_POSITIVE = _Rule("> 0", lambda v: v > 0)
_PORT = _Rule("in 1..65535", lambda v: 1 <= v <= 65535)
_NONEMPTY = _Rule("a non-empty string", lambda v: v is None or bool(v.strip()))
_NAME = _pattern(r"[a-z0-9][a-z0-9_.-]*", "lowercase letters, digits, '_', '.', '-'")
_SIZE_RULE = _Rule("WIDTHxHEIGHT with positive integers (e.g. 1024x1024)", lambda v: _ok(parse_size, v))
_REQUIRES_RULE = _Rule("a requirement like 'omni-run>=0.1' or ''", lambda v: not v or _ok(parse_requirement, v))


def _ok(parser: Callable, value: object) -> bool:
    try:
        parser(value)
    except RecipeError:
        return False
    return True


@functools.cache
def platform_choices() -> tuple[str, ...]:
    """``auto``, the built-in platforms, then any third-party platform installed under ``omni.platforms``."""
    extra = sorted({ep.name for ep in entry_points(group=PLATFORM_GROUP)} - set(BUILTIN_PLATFORMS))
    return ("auto", *BUILTIN_PLATFORMS, *extra)


def _opt(default, doc: str, *, choices=(), rule: _Rule | None = None, parse: Callable | None = None):
    """A recipe field: default, one-line doc, allowed values (tuple or callable), rule, input parser."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "rule": rule, "parse": parse})


def _section(cls):
    return field(default_factory=cls, metadata={"doc": cls.__doc__.split("\n")[0]})


def _choices(f: dataclasses.Field) -> tuple:
    choices = f.metadata.get("choices", ())
    return choices() if callable(choices) else choices


def _type_name(tp) -> str:
    if isinstance(tp, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(tp) or ("a list of result entries" if typing.get_origin(tp) is tuple else "a mapping")


def _is_type(tp, value: object) -> bool:
    if isinstance(tp, types.UnionType):
        return any(_is_type(a, value) for a in typing.get_args(tp))
    if tp is int or tp is float:
        return isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool)
    if typing.get_origin(tp) is tuple:
        return isinstance(value, tuple) and all(isinstance(v, FrozenDict) for v in value)
    return value is None if tp is type(None) else isinstance(value, tp)


def _show(value: object) -> str:
    return f"{type(value).__name__} {value!r}" if value is not None else "null"


def _check_field(f: dataclasses.Field, value: object) -> None:
    if not _is_type(f.type, value):
        raise RecipeError(f"expected {_type_name(f.type)}, got {_show(value)}", f.name)
    choices = _choices(f)
    if choices and value not in choices:
        raise RecipeError(f"{value!r} is not allowed; allowed values: {', '.join(map(str, choices))}", f.name)
    rule = f.metadata.get("rule")
    if rule is not None and not rule.ok(value):
        raise RecipeError(f"must be {rule.text}, got {value!r}", f.name)


class _Validated:
    """Mixin: every section validates itself on construction (load, replace and direct use alike)."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_field(f, getattr(self, f.name))
        self._rules()

    def _rules(self) -> None:
        """Cross-field rules; raise RecipeError with the key relative to this section."""


# ------------------------------------------------------------------ the schema


@dataclass(frozen=True, kw_only=True, slots=True)
class Device(_Validated):
    """The kind of device this deployment runs on, and how many of them."""

    kind: str = _opt("cpu", "device model the recipe was sized for, e.g. cpu, h200, h100, mi300x, a2, a3",
                     rule=_pattern(r"[a-z0-9][a-z0-9_-]*", "lowercase letters, digits, '_', '-'"))
    count: int = _opt(1, "devices used on one host; must equal parallel world size (one process per device)",
                      rule=_at_least(1))
    memory_gib: float = _opt(0.0, "minimum memory per device in GiB as the runtime reports it; 0 = not stated",
                             rule=_at_least(0), parse=_parse_float)
    memory_limit_gib: float = _opt(0.0, "cap on this process's device memory in GiB (a share of a card); allocations "
                                        "beyond it fail; 0 = no cap", rule=_at_least(0), parse=_parse_float)

    def _rules(self) -> None:
        if self.memory_limit_gib and self.memory_gib and self.memory_limit_gib > self.memory_gib:
            raise RecipeError(f"must be <= device.memory_gib ({self.memory_gib:g}), got {self.memory_limit_gib:g}",
                              "memory_limit_gib")


@dataclass(frozen=True, kw_only=True, slots=True)
class Model(_Validated):
    """Which model, where its weights are, and in which precision it runs."""

    flavor: str = _opt(TINY_FLAVOR, "model definition: hunyuan_image3 (released 80B MoE) or the tiny test model",
                       choices=FLAVORS)
    path: str | None = _opt(None, "Hugging Face-format directory with safetensors; null = embedded tiny weights "
                                  "(a released flavor then needs --model PATH)", rule=_NONEMPTY)
    dtype: str = _opt("bfloat16", "dtype of transformer weights and activations", choices=DTYPES)
    vae_dtype: str = _opt("float32", "dtype of the VAE decoder", choices=DTYPES)


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallel(_Validated):
    """Mesh degrees; world size = dp * cfg * ulysses * ring * tp, one process per device."""

    tp: int = _opt(1, "tensor parallel: attention heads and expert intermediate dims split over tp ranks",
                   rule=_at_least(1))
    ep: int = _opt(1, "expert parallel: experts spread over ep ranks (divides the world size)", rule=_at_least(1))
    ulysses: int = _opt(1, "sequence parallel, Ulysses all-to-all over image tokens", rule=_at_least(1))
    ring: int = _opt(1, "sequence parallel, ring attention (K/V rotation)", rule=_at_least(1))
    cfg: int = _opt(1, "guidance rows on separate rank groups: 1 (packed in one forward) or 2", choices=(1, 2))
    dp: int = _opt(1, "data parallel: independent replicas", rule=_at_least(1))

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.ulysses * self.ring * self.tp

    def _rules(self) -> None:
        if self.ep > self.world_size or self.world_size % self.ep:
            raise RecipeError(f"must divide the world size {self.world_size} (dp*cfg*ulysses*ring*tp), "
                              f"got {self.ep}", "ep")


@dataclass(frozen=True, kw_only=True, slots=True)
class Quant(_Validated):
    """Weight/activation quantization of linear layers."""

    scheme: str = _opt("none", "none; fp8_tensor / fp8_row (e4m3, per-tensor / per-row scale); mxfp8; nvfp4; "
                               "w8a8 (int8)", choices=QUANT_SCHEMES)
    experts_only: bool = _opt(False, "quantize only MoE expert weights; attention and dense layers keep model.dtype")


@dataclass(frozen=True, kw_only=True, slots=True)
class Attention(_Validated):
    """Preferred attention backend (a platform that cannot honour it refuses with a reason)."""

    backend: str = _opt("auto", "auto (the platform picks); sdpa; varlen (torch varlen); fa3 (FlashAttention-3); "
                                "flex (FlexAttention); fia (Ascend fused infer attention); aiter (AMD)",
                        choices=ATTENTION_BACKENDS)


@dataclass(frozen=True, kw_only=True, slots=True)
class KvCache(_Validated):
    """The per-worker KV pool holding each request's prefix K/V."""

    mode: str = _opt("paged", "paged (fixed pages, block tables) or contiguous (one slab per request row)",
                     choices=("paged", "contiguous"))
    budget_bytes: int = _opt(2 * GiB, "pool size per worker: integer bytes or a string like '16GiB', '512MiB'",
                             rule=_POSITIVE, parse=parse_bytes)
    page_tokens: int = _opt(256, "tokens per page when paged (platforms may require a multiple of 16 or more)",
                            rule=_at_least(1))


@dataclass(frozen=True, kw_only=True, slots=True)
class Offload(_Validated):
    """Weights kept in pinned host memory and streamed to the device."""

    mode: str = _opt("none", "none; layers (transformer layers streamed); experts (MoE experts streamed); "
                             "text (embeddings/LM head on host); vae (VAE on host until decode)",
                     choices=("none", "layers", "experts", "text", "vae"))
    resident_layers: int = _opt(0, "layers kept on the device permanently when streaming layers or experts",
                                rule=_at_least(0))
    prefetch_window: int = _opt(1, "layers fetched ahead on a side stream", rule=_at_least(1))


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCache(_Validated):
    """TeaCache-style step skipping (off by default; measure quality before enabling)."""

    enabled: bool = _opt(False, "skip a step's transformer when its modulated input barely changed")
    threshold: float = _opt(0.1, "accumulated relative L1 change below which a step is skipped",
                            rule=_POSITIVE, parse=_parse_float)


@dataclass(frozen=True, kw_only=True, slots=True)
class Graph(_Validated):
    """Device-graph capture of the denoising step."""

    mode: str = _opt("eager", "eager, or capture (record per shape bucket and replay; needs platform support)",
                     choices=("eager", "capture"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Vae(_Validated):
    """VAE decode tiling (tiles are spread across ranks)."""

    tiling: bool = _opt(False, "decode in overlapping latent tiles to bound memory")
    tile_latents: int = _opt(32, "tile side in latent pixels", rule=_at_least(1))
    overlap: int = _opt(8, "overlap between tiles in latent pixels, blended; < tile_latents", rule=_at_least(0))
    streams: int = _opt(1, "tiles decoded at once on this many device streams (each holds one tile's activations); "
                           "needs tiling", rule=_at_least(1))

    def _rules(self) -> None:
        if self.overlap >= self.tile_latents:
            raise RecipeError(f"must be < tile_latents ({self.tile_latents}), got {self.overlap}", "overlap")
        if self.streams > 1 and not self.tiling:
            raise RecipeError(f"vae.streams={self.streams} decodes tiles concurrently, but vae.tiling is false; "
                              "set vae.tiling: true or vae.streams: 1", "streams")


@dataclass(frozen=True, kw_only=True, slots=True)
class Serving(_Validated):
    """HTTP server limits (omni-run serve)."""

    host: str = _opt("127.0.0.1", "address to bind; 0.0.0.0 exposes the server to the network", rule=_NONEMPTY)
    port: int = _opt(8091, "TCP port to listen on", rule=_PORT)
    max_queue: int = _opt(64, "requests waiting beyond the running ones before 429 (0 = none wait)",
                          rule=_at_least(0))
    max_running: int = _opt(8, "requests denoising together (step-level batching)", rule=_at_least(1))
    max_batch_tokens: int = _opt(32768, "packed tokens per forward (all rows of all running requests)",
                                 rule=_at_least(1))
    request_timeout_s: float = _opt(600.0, "seconds before a request is cancelled", rule=_POSITIVE,
                                    parse=_parse_float)
    api_key_env: str | None = _opt(None, "name of the environment variable holding the API key; null = no key",
                                   rule=_pattern(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable name"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Defaults(_Validated):
    """Generation parameters used when a request does not give them."""

    steps: int = _opt(50, "denoising steps", rule=_at_least(1))
    guidance: float = _opt(5.0, "classifier-free guidance scale s (v = v_uncond + s * (v_cond - v_uncond))",
                           rule=_at_least(0), parse=_parse_float)
    size: str = _opt("1024x1024", "image size WIDTHxHEIGHT", rule=_SIZE_RULE)
    shift: float = _opt(3.0, "flow-matching timestep shift", rule=_POSITIVE, parse=_parse_float)
    template: str = _opt("pretrain", "sequence template: pretrain (base model) or instruct (User:/Assistant:)",
                         choices=("pretrain", "instruct"))
    system_prompt: str | None = _opt(None, "text prepended as the system prompt; null = none")

    @property
    def width_height(self) -> tuple[int, int]:
        return parse_size(self.size)


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe(_Validated):
    """One deployment: model, device, layout, precision, caching, serving limits."""

    name: str = field(metadata={"doc": "recipe name, by convention the file stem <device>_<layout>",
                                "rule": _NAME})
    description: str = _opt("", "one line shown by omni-run recipes")
    platform: str = _opt("auto", "platform plugin: auto (the single accelerator found), cpu, cuda, rocm, npu, "
                                 "xpu, musa, or an installed third-party platform", choices=platform_choices)
    requires: str = _opt("", "platform package requirement, e.g. 'omni-run>=0.1'; '' = none",
                         rule=_REQUIRES_RULE)
    device: Device = _section(Device)
    model: Model = _section(Model)
    parallel: Parallel = _section(Parallel)
    quant: Quant = _section(Quant)
    attention: Attention = _section(Attention)
    kv_cache: KvCache = _section(KvCache)
    offload: Offload = _section(Offload)
    step_cache: StepCache = _section(StepCache)
    graph: Graph = _section(Graph)
    vae: Vae = _section(Vae)
    serving: Serving = _section(Serving)
    defaults: Defaults = _section(Defaults)
    validated: tuple[FrozenDict, ...] = _opt((), "results on real hardware: a list of {date, hardware, commit, "
                                                 "<metric>: <value>} entries", parse=_parse_validated)

    def _rules(self) -> None:
        p = self.parallel
        if p.world_size != self.device.count:
            raise RecipeError(f"{self.device.count} device(s) but the parallel world size is {p.world_size} "
                              f"(dp {p.dp} * cfg {p.cfg} * ulysses {p.ulysses} * ring {p.ring} * tp {p.tp}); "
                              "they must be equal (one process per device)", "device.count")
        if self.quant.experts_only and self.quant.scheme == "none":
            raise RecipeError("true needs a quant.scheme other than none", "quant.experts_only")
        if self.offload.mode in ("layers", "experts", "vae") and self.graph.mode == "capture":
            raise RecipeError(f"offload.mode={self.offload.mode} conflicts with graph.mode=capture: streamed "
                              "weights move between device slots, which a captured graph cannot follow; "
                              "use graph.mode=eager or offload.mode=none|text", "offload.mode")

    def get_path(self, path: str) -> object:
        """The value at a dotted path such as ``"parallel.tp"``."""
        obj = self
        for part in path.split("."):
            if not is_dataclass(obj):
                raise RecipeError(f"not a section, so it has no key {part!r}", path)
            obj = getattr(obj, _field_of(obj, part, path).name)
        return obj

    def replace_path(self, path: str, value: object) -> "Recipe":
        """A new Recipe with one leaf changed (validated like YAML input: '2GiB' works)."""
        return self.replace_paths({path: value})

    def replace_paths(self, changes: Mapping[str, object]) -> "Recipe":
        """A new Recipe with several leaves changed at once, validated once at the end."""
        tree = _Tree()
        try:
            for path, value in changes.items():
                _insert(tree, path, value)
            return _apply(self, tree)
        except RecipeError as e:
            raise e.within(source=e.source or f"recipe {self.name}") from None


# ------------------------------------------------------------------ building and replacing


class _Tree(dict):
    """Nested changes: ``{"parallel": _Tree(tp=2)}`` (a plain dict value is a leaf value)."""


def _insert(tree: _Tree, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, _Tree())
        if not isinstance(node, _Tree):
            raise RecipeError(f"conflicts with a change of {part}", path)
    if leaf in node:
        raise RecipeError("changed twice", path)
    node[leaf] = value


def _field_of(obj, name: str, key: str = "") -> dataclasses.Field:
    by_name = {f.name: f for f in fields(obj)}
    if name not in by_name:
        raise RecipeError(f"unknown key {name!r}; allowed: {', '.join(by_name)}", key or name)
    return by_name[name]


def _coerce(f: dataclasses.Field, value: object) -> object:
    """YAML or override input -> the field's stored value (validation happens on construction)."""
    if is_dataclass(f.type):
        return _build(f.type, value)
    parse = f.metadata.get("parse")
    return parse(value) if parse else value


def _build(cls, data: object):
    if data is None:
        data = {}
    names = [f.name for f in fields(cls)]
    if not isinstance(data, Mapping):
        raise RecipeError(f"expected a mapping with keys {', '.join(names)}, got {_show(data)}")
    kwargs = {}
    for key, value in data.items():
        f = _field_of(cls, key if isinstance(key, str) else repr(key))
        try:
            kwargs[key] = _coerce(f, value)
        except RecipeError as e:
            raise e.within(key) from None
    for f in fields(cls):
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise RecipeError(f"missing required key ({f.metadata['doc']})", f.name)
    return cls(**kwargs)


def _apply(obj, tree: _Tree):
    kwargs = {}
    for name, change in tree.items():
        f = _field_of(obj, name)
        try:
            if isinstance(change, _Tree):
                if not is_dataclass(f.type):
                    raise RecipeError(f"is not a section; it has no key {next(iter(change))!r}")
                kwargs[name] = _apply(getattr(obj, name), change)
            elif is_dataclass(f.type):
                raise RecipeError(f"is a section; change its keys ({', '.join(x.name for x in fields(f.type))})")
            else:
                kwargs[name] = _coerce(f, change)
        except RecipeError as e:
            raise e.within(name) from None
    return dataclasses.replace(obj, **kwargs)


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
