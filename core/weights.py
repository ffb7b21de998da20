"""Load safetensors checkpoints (HF layout) onto modules, shard by shard, memory-mapped.

A checkpoint directory holds ``config.json`` and either ``model.safetensors``
or shards listed by ``model.safetensors.index.json``. Each checkpoint name is
routed to a ``LoadTarget`` by prefix; the target's ``name_map`` turns the
official name into (parameter name, index into a stacked dim or None).
Problems are collected over the whole checkpoint and raised once, naming
every missing, unexpected and mis-shaped key (with both shapes).
Pre-quantized FP8 checkpoints (ModelOpt names: ``weight`` in e4m3 beside
``weight_scale`` and ``input_scale``) load their scales into the buffers that
``omni.layers.declare_prequantized`` registers; a scale matches its buffer by
element count, or broadcasts when it is a single value.
Only safetensors are read: no pickle, no remote code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

INDEX = "model.safetensors.index.json"
SCALE_SUFFIXES = ("weight_scale", "input_scale")  # ModelOpt FP8 names, loaded into buffers
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the keys and the shapes."""


@dataclass(frozen=True)
class LoadTarget:
    prefix: str  # official-name prefix routed here ("" = everything else)
    module: torch.nn.Module
    # official name (prefix removed) -> (parameter, index into a stacked dim or None); (None, None) means
    # "held by another rank": the tensor is skipped unread (expert parallelism)
    name_map: Callable[[str], tuple[str | None, int | None]] = lambda n: (n, None)
    # (official name without prefix, lazily sliceable tensor) -> the part this rank holds, read by slicing
    # so only those bytes leave the file (tensor parallelism); None copies the whole tensor
    read: Callable[[str, object], torch.Tensor] | None = None


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    root = Path(path)
    if (root / INDEX).is_file():
        try:
            files = [root / f for f in sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{root / INDEX}: not a safetensors index with a weight_map ({e!r})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{root}: {INDEX} names {len(missing)} of its {len(files)} shards that are not "
                                  f"there ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an "
                                  "interrupted download?")
        return files
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{root}: no {INDEX}, {SINGLE} or *.safetensors found (only safetensors are supported)")
    return found


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A parameter, or a registered buffer (checkpoint scales: ``weight_scale``, ``input_scale``)."""
    try:
        return module.get_parameter(name)
    except AttributeError:
        buf = module.get_buffer(name)
        if buf is None:
            raise
        return buf


def _source(target, local: str, name: str, shape, read, part, dest) -> tuple[torch.Tensor | None, str]:
    """What to copy into ``dest`` (this rank's part where the target reads a shard of it), or why nothing fits."""
    sliced = target.read is not None and part is not None
    if _is_scale(name):  # a rank's part of a scale is cut by the target, then fitted like any scale
        cut = sliced and len(shape) > 0  # a 0-dim scale is whole
        src = _fit_scale(target.read(local, part()) if cut else read(), dest)
        if src is None:
            return None, (f"checkpoint scale {tuple(shape)} vs model {tuple(dest.shape)} "
                          f"(per-row scales need quant.scheme=fp8_row)")
        return src, ""
    if sliced:
        src = target.read(local, part())
        if tuple(src.shape) != tuple(dest.shape):
            return None, f"this rank's part {tuple(src.shape)} vs sharded model {tuple(dest.shape)}"
        return src, ""
    if tuple(shape) != tuple(dest.shape):
        return None, f"checkpoint {tuple(shape)} vs model {tuple(dest.shape)}"
    return read(), ""


def _is_scale(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def _fit_scale(src: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
    """A checkpoint scale reshaped to its buffer: same element count, or one value broadcast; else None."""
    if src.numel() == dest.numel():
        return src.reshape(dest.shape)
    if src.numel() == 1:
        return src.reshape(()).expand(dest.shape)
    return None


class _Loader:
    """Routes keys to parameters, copies them and records what was filled or wrong."""

    def __init__(self, targets: list[LoadTarget]):
        self.targets = targets
        self.filled: dict[tuple[int, str], set] = {}
        self.problems: list[str] = []

    def _dest(self, key: str):
        routed = [t for t in self.targets if key.startswith(t.prefix)]
        if not routed:
            return None, None, None
        target = max(routed, key=lambda t: len(t.prefix))
        try:
            name, index = target.name_map(key[len(target.prefix):])
            if name is None:
                return target, None, None  # held by another rank
            return target, name, _tensor(target.module, name)
        except (KeyError, AttributeError):
            return None, None, None

    def load(self, key: str, shape: tuple[int, ...], read: Callable[[], torch.Tensor], origin: str,
             part: Callable[[], object] | None = None) -> None:
        """``part()`` gives a lazily sliceable view of the tensor for targets that read a shard."""
        target, name, param = self._dest(key)
        if target is not None and name is None:
            return None
        if param is None:
            return self.problems.append(f"unexpected {key} ({origin})")
        local = key[len(target.prefix):]
        index = target.name_map(local)[1]
        dest = param.data if index is None else param.data[index]
        if dest.is_meta:  # a copy into meta storage would "succeed" and keep nothing
            return self.problems.append(f"{key}: its part of the model was never materialized ({origin})")
        src, problem = _source(target, local, name, shape, read, part, dest)
        if problem:
            return self.problems.append(f"{key}: {problem} ({origin})")
        dest.copy_(src.to(dest.dtype))
        self.filled.setdefault((id(target.module), name), set()).add(index)

    def missing(self) -> list[str]:
        out = []
        for t in self.targets:
            for n, p in t.module.named_parameters():
                got = self.filled.get((id(t.module), n), set())
                if not got:
                    out.append(f"missing {t.prefix}{n}")
                elif None not in got and len(got) < p.shape[0]:
                    absent = sorted(set(range(p.shape[0])) - got)
                    out.append(f"missing {t.prefix}{n} entries {absent[:8]}")
        return out

    def finish(self, what: str, strict: bool) -> None:
        problems = self.problems + (self.missing() if strict else [])
        if problems:
            raise CheckpointError(f"{what} does not fit the model ({len(problems)} problem(s)):\n  "
                                  + "\n  ".join(problems))


def load_checkpoint(path: str | Path, targets: list[LoadTarget], *, skip_prefixes: tuple[str, ...] = (),
                    strict: bool = True, progress: bool = True, files: list[Path] | None = None) -> None:
    """Copy every tensor of the checkpoint into its target parameter (dtype converted), in one pass."""
    StreamingLoad(path, targets, skip_prefixes=skip_prefixes, files=files).finish(strict=strict, progress=progress)


class StreamingLoad:
    """One checkpoint loaded in parts (a decoder layer at a time), checked once at the end.

    For builds whose model does not fit where it is built: the caller
    materializes a part (``materialize_meta_``), loads the keys that select it,
    prepares and places it, and goes on; ``finish()`` loads what no part
    claimed and reports every missing, unexpected and mis-shaped key of all
    parts together. ``load_checkpoint`` is the one-part case.
    """

    def __init__(self, path: str | Path, targets: list[LoadTarget], *, skip_prefixes: tuple[str, ...] = (),
                 files: list[Path] | None = None):
        self.path, self.loader = path, _Loader(targets)
        self.pending: dict[str, Path] = {}  # key -> its file, for keys not loaded yet
        for file in files or checkpoint_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                self.pending.update((k, file) for k in f.keys() if not k.startswith(skip_prefixes))

    @torch.no_grad()
    def load(self, select: Callable[[str], bool], progress: bool = False) -> int:
        """Load the pending keys ``select`` accepts (their destinations must be materialized); returns how many."""
        keys = [k for k in self.pending if select(k)]
        bar = tqdm(total=len(keys), desc="loading", disable=not progress, leave=False)
        for file in sorted({self.pending[k] for k in keys}):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in (k for k in keys if self.pending[k] == file):
                    self.loader.load(key, f.get_slice(key).get_shape(), lambda k=key: f.get_tensor(k), file.name,
                                     part=lambda k=key: f.get_slice(k))
                    bar.update()
        bar.close()
        for k in keys:
            del self.pending[k]
        return len(keys)

    def finish(self, strict: bool = True, progress: bool = False) -> None:
        self.load(lambda k: True, progress)  # whatever no part claimed is filled or reported (unexpected)
        self.loader.finish(f"checkpoint {self.path}", strict)


@torch.no_grad()
def materialize_meta_(module: torch.nn.Module, device) -> int:
    """Give every still-``meta`` parameter and buffer of ``module`` (uninitialized) storage on ``device``.

    Parts materialized before keep their tensors, unlike ``Module.to_empty``. ``empty_strided``, not
    ``empty_like``: the latter on a meta tensor imports torch's symbolic shapes and sympy (0.6 s on the
    development CPU, a seventh of the default job).
    """
    n = 0
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, t in list(table.items()):
                if t is not None and t.is_meta:
                    new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                    table[name] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                    n += 1
    return n


@torch.no_grad()
def load_state_dict(tensors: Mapping[str, torch.Tensor], targets: list[LoadTarget], *,
                    skip_prefixes: tuple[str, ...] = (), strict: bool = True) -> None:
    """The same routing and checks for tensors already in memory."""
    loader = _Loader(targets)
    for key, t in tensors.items():
        if not key.startswith(skip_prefixes):
            loader.load(key, tuple(t.shape), lambda t=t: t, "state dict", part=lambda t=t: t)
    loader.finish("state dict", strict)
