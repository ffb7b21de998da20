"""Load safetensors checkpoints (HF layout) onto modules, shard by shard, memory-mapped.

A checkpoint directory holds ``config.json`` and either ``model.safetensors``
or shards listed by ``model.safetensors.index.json``. Each checkpoint name is
routed to a ``LoadTarget`` by prefix; the target's ``name_map`` turns the
official name into (parameter name, index into a stacked dim or None).
Only safetensors are read: no pickle, no remote code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the key and the shapes."""


@dataclass(frozen=True)
class LoadTarget:
    prefix: str  # official-name prefix routed here ("" = everything else)
    module: torch.nn.Module
    name_map: Callable[[str], tuple[str, int | None]] = lambda n: (n, None)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order."""
    root = Path(path)
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        return [root / f for f in sorted(set(weight_map.values()))]
    if (root / SINGLE).is_file():
        return [root / SINGLE]
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{root}: no {INDEX}, {SINGLE} or *.safetensors found (only safetensors are supported)")
    return found


class _Tracker:
    """Which parameter elements were filled, to report missing ones."""

    def __init__(self, targets: list[LoadTarget]):
        self.params = {(id(t), n): p for t in targets for n, p in t.module.named_parameters()}
        self.filled: dict[tuple[int, str], set] = {}

    def mark(self, target, name, index) -> None:
        self.filled.setdefault((id(target.module), name), set()).add(index)

    def missing(self, targets) -> list[str]:
        out = []
        for t in targets:
            for n, p in t.module.named_parameters():
                got = self.filled.get((id(t.module), n), set())
                if not got:
                    out.append(f"{t.prefix}{n}")
                elif None not in got and len(got) < p.shape[0]:
                    absent = sorted(set(range(p.shape[0])) - got)
                    out.append(f"{t.prefix}{n}[{', '.join(map(str, absent[:4]))}...]")
        return out


def load_checkpoint(path: str | Path, targets: list[LoadTarget], *, skip_prefixes: tuple[str, ...] = (),
                    strict: bool = True, progress: bool = True, files: list[Path] | None = None) -> None:
    """Copy every tensor of the checkpoint into its target parameter (dtype converted)."""
    tracker = _Tracker(targets)
    files = files or checkpoint_files(path)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = [k for k in f.keys() if not k.startswith(skip_prefixes)]
            for key in tqdm(keys, desc=f"loading {file.name}", disable=not progress, leave=False):
                _load_one(f, key, file, targets, tracker)
    missing = tracker.missing(targets)
    if strict and missing:
        raise CheckpointError(f"{path}: checkpoint lacks {len(missing)} parameter(s), first: {', '.join(missing[:5])}")


def _route(key: str, targets: list[LoadTarget]) -> LoadTarget | None:
    best = [t for t in targets if key.startswith(t.prefix)]
    return max(best, key=lambda t: len(t.prefix)) if best else None


def _load_one(f, key: str, file: Path, targets: list[LoadTarget], tracker: _Tracker) -> None:
    target = _route(key, targets)
    try:
        name, index = target.name_map(key[len(target.prefix):]) if target else (None, None)
        param = target.module.get_parameter(name) if target else None
    except (KeyError, AttributeError):
        param = None
    if param is None:
        raise CheckpointError(f"{file.name}: unexpected key {key!r} (no parameter of the model takes it)")
    dest = param.data if index is None else param.data[index]
    shape = tuple(f.get_slice(key).get_shape())
    if shape != tuple(dest.shape):
        raise CheckpointError(f"{file.name}: {key!r} has shape {list(shape)}, the model expects {list(dest.shape)}")
    dest.copy_(f.get_tensor(key).to(dest.dtype))
    tracker.mark(target, name, index)
