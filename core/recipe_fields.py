"""Recipe field machinery: value parsers, field metadata and checks, building sections from input.

Everything the schema (``omni.recipe_schema``) is declared with and validated
by; no section classes live here. Imports no torch and reads no environment.
"""
import dataclasses
import datetime
import functools
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from decimal import Decimal
from importlib.metadata import PackageNotFoundError, version as installed_version

from .installed_entry_points import of_group

PLATFORM_GROUP = "omni.platforms"
BUILTIN_PLATFORMS = ("cpu", "cuda", "rocm", "npu", "xpu", "musa")
VALIDATED_REQUIRED = ("date", "hardware", "commit")


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


def _between(lo: int, hi: int) -> _Rule:
    return _Rule(f"in {lo}..{hi}", lambda v: lo <= v <= hi)


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
    extra = sorted({ep.name for ep in of_group(PLATFORM_GROUP)} - set(BUILTIN_PLATFORMS))
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


# ------------------------------------------------------------------ building and replacing sections


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
