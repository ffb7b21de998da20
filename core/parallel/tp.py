"""Execute a model's parallel plan: swap modules for their local shards, attach comm hooks, cut checkpoints.

``apply_plan(model, plan, ...)`` walks the plan (module-FQN glob -> style,
``omni.parallel.styles``) and, for this rank of the mesh:

1. checks every size first and refuses with the reason (``MeshError``), e.g.
   tp that does not divide the KV heads;
2. rebuilds ``Heads`` modules from a config with the local head counts;
3. rebuilds each ``Colwise`` / ``Rowwise`` ``Linear`` or ``GroupedLinear``
   at its local shape (same class, same parameter names) and records how its
   checkpoint tensors are cut (``Shard``);
4. gives ``Experts`` modules their expert range and dispatch hooks;
5. registers an all-reduce forward hook for ``Rowwise(reduce=True)`` and
   ``ReduceOutput``;
6. wraps ``SequenceParallel`` kernels for Ulysses or ring attention.

Call it while the model is on the ``meta`` device (nothing allocated), then
``to_empty`` and load through ``PlanResult.load_target``: each rank reads only
its slices from the safetensors files (``get_slice``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from omni.build_options import BuildOptions
from omni.layers import GroupedLinear, Linear
from omni.weights import SCALE_SUFFIXES, LoadTarget

from .ep import ExpertShard
from .mesh import MeshError
from .styles import Colwise, Experts, Heads, ReduceOutput, Replicate, Rowwise, SequenceParallel, glob_matches


SCALES = tuple(f".{s}" for s in SCALE_SUFFIXES)


@dataclass(frozen=True)
class Shard:
    """This rank's part of a ``[O, I]`` (or ``[O]``) checkpoint tensor.

    ``dim`` 0 cuts out-features, 1 in-features; the dim is ``blocks`` equal
    blocks; ``whole_blocks`` hands consecutive whole blocks to each of the
    ``parts`` ranks, else every block is cut and the pieces concatenated.
    """

    dim: int
    parts: int
    index: int
    blocks: int = 1
    whole_blocks: bool = False

    def ranges(self, size: int) -> list[tuple[int, int]]:
        blk = size // self.blocks
        if self.whole_blocks:
            per = self.blocks // self.parts
            return [(self.index * per * blk, (self.index + 1) * per * blk)]
        sub = blk // self.parts
        return [(b * blk + self.index * sub, b * blk + (self.index + 1) * sub) for b in range(self.blocks)]

    def local(self, size: int) -> int:
        return sum(b - a for a, b in self.ranges(size))

    def take(self, t) -> torch.Tensor:
        """Read the part from a safetensors slice or a tensor (only the selected rows/cols are read)."""
        shape = t.get_shape() if hasattr(t, "get_shape") else t.shape
        pieces = [t[a:b] if self.dim == 0 else t[:, a:b] for a, b in self.ranges(shape[self.dim])]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)


@dataclass
class PlanResult:
    """What loading needs to know after ``apply_plan``: cut rules and expert ranges per parameter."""

    model: nn.Module
    shards: dict[str, Shard] = field(default_factory=dict)
    experts: dict[str, range] = field(default_factory=dict)  # stacked expert parameter -> global experts held

    def name_map(self, official: str) -> tuple[str | None, int | None]:
        name, index = self.model.param_name_for(official)
        held = self.experts.get(name)
        if held is not None and index is not None:
            return (None, None) if index not in held else (name, index - held.start)
        return name, index

    def read(self, official: str, part) -> torch.Tensor:
        name = self.model.param_name_for(official)[0]
        if name.endswith(SCALES):  # a pre-quantized checkpoint's scale follows its weight's rows
            return self._read_scale(name, part)
        shard = self.shards.get(name)
        return part[:] if shard is None else shard.take(part)

    def _read_scale(self, name: str, part) -> torch.Tensor:
        """Per-row weight scales are cut with the out-features (column-parallel); the rest is whole.

        Row-parallel layers keep every output row, per-tensor scales and the
        static ``input_scale`` hold one value for the whole tensor.
        """
        shard = self.shards.get(name.rpartition(".")[0] + ".weight")
        shape = part.get_shape() if hasattr(part, "get_shape") else part.shape
        per_row = name.endswith("weight_scale") and len(shape) >= 1 and shape[0] > 1
        return shard.take(part) if shard is not None and shard.dim == 0 and per_row else part[:]

    def load_target(self, prefix: str = "") -> LoadTarget:
        return LoadTarget(prefix, self.model, self.name_map, self.read)


def apply_plan(model: nn.Module, plan: dict | list[dict], *, mesh, platform, cfg,
               opts: BuildOptions) -> PlanResult:
    """Shard ``model`` in place for this rank (see the module docstring); returns the load rules.

    ``plan``: one dict or several (a glob may appear in more than one, e.g.
    ``Heads`` in the TP plan and ``SequenceParallel`` in the SP plan).
    ``opts``: the options the model was built with; ``Heads`` modules and the
    ``SequenceParallel`` attention kernels are built again from them.
    """
    entries = _match(model, [plan] if isinstance(plan, dict) else plan)
    sizes = {name: _shape(m) for name, m in model.named_modules() if isinstance(m, (Linear, GroupedLinear))}
    check_plan(entries, cfg, mesh, sizes)
    result = PlanResult(model)
    _rebuild_heads(model, entries, cfg, mesh.size("tp"), platform, opts)
    held = _expert_ranges(entries, cfg, mesh)
    for name, style in entries:
        if isinstance(style, (Colwise, Rowwise)):
            experts = held.get(name.rpartition(".")[0], (None,))[0]
            _shard_linear(model, name, style, sizes[name], experts, cfg, mesh, platform, result)
    for name, (rng, total) in held.items():
        module = model.get_submodule(name)
        result.experts.update({f"{name}.{p}": rng for p, _ in module.named_parameters()})
        ExpertShard(rng, total, mesh.comm("dispatch")).attach(module)
    _attach_reductions(model, entries, mesh)
    if mesh.sp_kind != "none":
        from .sequence import install_sp_kernels

        for name, style in entries:
            if isinstance(style, SequenceParallel):
                install_sp_kernels(model.get_submodule(name), style, mesh=mesh, platform=platform, cfg=cfg,
                                   opts=opts)
    return result


def _rebuild_heads(model, entries, cfg, tp: int, platform, opts: BuildOptions) -> None:
    """``Heads``: the module built again from a config with tp-local head counts."""
    if tp == 1:
        return
    for name, style in entries:
        if isinstance(style, Heads):
            local = dataclasses.replace(cfg, **{style.heads: getattr(cfg, style.heads) // tp,
                                                style.kv_heads: getattr(cfg, style.kv_heads) // tp})
            old = model.get_submodule(name)
            _replace(model, name, type(old)(local, old.layer_idx, platform=platform, opts=opts))


def _expert_ranges(entries, cfg, mesh) -> dict[str, tuple[range, int]]:
    """``Experts`` module -> (global experts this rank holds, total experts), when experts are split."""
    if mesh.experts.groups == 1:
        return {}
    return {name: (mesh.experts.expert_range(getattr(cfg, style.count)), getattr(cfg, style.count))
            for name, style in entries if isinstance(style, Experts)}


def _attach_reductions(model, entries, mesh) -> None:
    """All-reduce hooks for ``Rowwise(reduce=True)`` and ``ReduceOutput``."""
    for name, style in entries:
        reduce = isinstance(style, ReduceOutput) or (isinstance(style, Rowwise) and style.reduce)
        comm = mesh.comm(_comm_axis(style.axis)) if reduce else None
        if comm is not None and comm.size > 1:
            model.get_submodule(name).register_forward_hook(AllReduceOutput(comm))


class AllReduceOutput:
    """Forward hook: sum the module's output over one mesh axis (in place)."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, module, args, out):
        return self.comm.all_reduce(out)

    def __repr__(self) -> str:
        return f"AllReduceOutput({self.comm.axis})"


# ---------------------------------------------------------------------- checks


def check_plan(entries: list, cfg, mesh, sizes: dict) -> None:
    """Refuse, with the reason, a split this model cannot take (before anything is changed)."""
    tp = mesh.size("tp")
    for name, style in entries:
        if isinstance(style, Heads):
            _check_heads(cfg, style, tp)
        elif isinstance(style, (Colwise, Rowwise)):
            parts = _parts(mesh, style.axis)[1]
            if isinstance(style, Colwise):
                size, blocks, what = sizes[name][1], _blocks(cfg, style), "output"
                ok = size % blocks == 0 and (blocks % parts == 0 if style.whole_blocks
                                             else (size // blocks) % parts == 0)
            else:
                size, blocks, what = sizes[name][0], 1, "input"
                ok = size % parts == 0
            if not ok:
                raise MeshError(f"{name}: {what} features {size} ({blocks} block(s)) cannot be split over "
                                f"{parts} ranks ({style.axis}) for parallel degrees {mesh.degrees.label()}")
        elif isinstance(style, Experts):
            mesh.experts.expert_range(getattr(cfg, style.count))


def _check_heads(cfg, style: Heads, tp: int) -> None:
    n, k = getattr(cfg, style.heads), getattr(cfg, style.kv_heads)
    if k % tp == 0:
        return
    divisors = [d for d in range(1, k + 1) if k % d == 0]
    raise MeshError(
        f"parallel.tp={tp} cannot split {style.kv_heads}={k}: qkv_proj is packed per KV group "
        f"([q x {n // k}, k, v] for each of the {k} groups) and every tp rank must own whole KV groups, "
        f"so tp must divide {k} (one of {divisors}). Replicating KV groups over ranks (tp > kv heads) is not "
        "implemented; reach more ranks with cfg, ulysses, ring or dp instead.")


def _match(model: nn.Module, plans: list[dict]) -> list[tuple[str, object]]:
    """(module name, style) for every module a non-Replicate entry matches; a stale entry is an error."""
    names = [n for n, _ in model.named_modules()]
    entries = []
    for plan in plans:
        for pattern, style in plan.items():
            if isinstance(style, Replicate):
                continue  # documentation: optional modules (e.g. Distil-only embedders) may be absent
            hits = [n for n in names if glob_matches(pattern, n)]
            if not hits:
                raise MeshError(f"parallel plan entry {pattern!r} matches no module of {type(model).__name__} "
                                "(the plan is out of date with the model)")
            entries += [(n, style) for n in hits]
    return entries


# ---------------------------------------------------------------------- linear layers


def _shape(m) -> tuple[int, int, int | None]:
    """(in features, out features, experts or None) of a Linear / GroupedLinear."""
    s = m.spec
    return s.in_features, s.out_features, getattr(s, "num_experts", None)


def _comm_axis(axis: str) -> str:
    return "tp" if axis == "expert_tp" else axis


def _parts(mesh, axis: str) -> tuple[int, int]:
    """(index, parts) of this rank for a split axis."""
    if axis == "expert_tp":
        return mesh.experts.expert_tp_index, mesh.experts.expert_tp
    return mesh.index(axis), mesh.size(axis)


def _blocks(cfg, style: Colwise) -> int:
    return getattr(cfg, style.blocks) if isinstance(style.blocks, str) else style.blocks


def _shard_linear(model, name: str, style, full: tuple, experts: range | None, cfg, mesh, platform,
                  result: PlanResult) -> None:
    index, parts = _parts(mesh, style.axis)
    if isinstance(style, Colwise):
        shard = Shard(0, parts, index, _blocks(cfg, style), style.whole_blocks)
        in_f, out_f = full[0], shard.local(full[1])
    else:
        shard = Shard(1, parts, index)
        in_f, out_f = shard.local(full[0]), full[1]
    old = model.get_submodule(name)
    num_experts = len(experts) if experts is not None else full[2]
    if (in_f, out_f, num_experts) != _shape(old):
        _replace(model, name, _rebuild(old, in_f, out_f, num_experts, platform))
    if parts > 1:
        result.shards[f"{name}.weight"] = shard
        if getattr(old.spec, "bias", False):
            if isinstance(style, Rowwise):
                raise MeshError(f"{name}: a row-parallel layer with a bias is not supported (add it on one rank)")
            result.shards[f"{name}.bias"] = dataclasses.replace(shard, dim=0)


def _rebuild(old, in_f: int, out_f: int, num_experts: int | None, platform):
    s = old.spec
    if isinstance(old, GroupedLinear):
        return GroupedLinear(num_experts, in_f, out_f, platform=platform, dtype=s.dtype, quant=s.quant,
                             fast_accum=s.fast_accum, grouped_fp8=s.grouped_fp8, small_rows=s.small_rows)
    return Linear(in_f, out_f, platform=platform, dtype=s.dtype, bias=s.bias, quant=s.quant,
                  memory_bound=s.memory_bound, fast_accum=s.fast_accum, skinny_rows=s.skinny_rows,
                  pdl_rows=s.pdl_rows)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
