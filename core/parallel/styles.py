"""The vocabulary of parallel plans: how one module is sharded (pure data, no torch.distributed).

A model folder's ``parallel.py`` maps module-FQN globs (``*`` = one path
segment) to these styles; ``omni.parallel.tp.apply_plan`` executes them.
Importing this module imports nothing distributed, so model code may use it.

Size words: ``tp`` = the tensor-parallel degree; ``expert_tp`` = how many
ranks split one routed expert's intermediate dim (``tp / ep`` when the
expert-parallel group lies inside the tp group, else ``tp``; see
``omni.parallel.mesh.ExpertLayout``).
"""
from __future__ import annotations

from dataclasses import dataclass

AXES_FOR_LINEAR = ("tp", "expert_tp")


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole module (``why`` says so in the plan)."""

    why: str = ""


@dataclass(frozen=True)
class Colwise:
    """Output features split over ``axis`` (column-parallel ``Linear`` / ``GroupedLinear``).

    The out dim is read as ``blocks`` equal blocks (an int, or the name of a
    config field). ``whole_blocks=True``: each rank takes whole, consecutive
    blocks (qkv_proj packed per KV group: ``blocks="num_key_value_heads"``).
    ``whole_blocks=False``: every block is split and each rank keeps its part
    of each (gate_and_up_proj ``[gate | up]``: ``blocks=2``). No reduction.
    """

    blocks: int | str = 1
    whole_blocks: bool = False
    axis: str = "tp"


@dataclass(frozen=True)
class Rowwise:
    """Input features split over ``axis`` (row-parallel); ``reduce`` all-reduces the output over it."""

    reduce: bool = True
    axis: str = "tp"


@dataclass(frozen=True)
class Heads:
    """An attention layer rebuilt with 1/tp of its query and KV heads (whole KV groups per rank).

    The module is constructed again as ``type(m)(local_cfg, m.layer_idx, platform=..., opts=...)``
    where ``local_cfg`` has the named config fields divided by tp; its
    kernels are therefore resolved for the local head counts. The children's
    Colwise/Rowwise entries say how their checkpoint tensors are sliced.
    """

    heads: str = "num_attention_heads"
    kv_heads: str = "num_key_value_heads"


@dataclass(frozen=True)
class Experts:
    """Routed experts with stacked ``[E, ...]`` weights: spread over expert groups (EP).

    The module keeps ``E / groups`` experts; tokens reach them by selecting the
    local assignments (tokens replicated on the group) or by all-to-all
    dispatch and combine (tokens differ across the group). Forward contract:
    ``module(x_TD, weights_Tk, experts_Tk) -> y_TD`` with global expert ids.
    """

    count: str = "num_experts"


@dataclass(frozen=True)
class ReduceOutput:
    """All-reduce the module's output over ``axis`` (one reduction for several row-parallel parts)."""

    axis: str = "tp"


@dataclass(frozen=True)
class SequenceParallel:
    """Attention kernels (the dict ``kernels`` of mask -> kernel) wrapped for Ulysses or ring attention."""

    kernels: str = "attn"
    heads: str = "num_attention_heads"
    kv_heads: str = "num_key_value_heads"
    head_dim: str = "head_dim"


Style = Replicate | Colwise | Rowwise | Heads | Experts | ReduceOutput | SequenceParallel


def glob_matches(pattern: str, fqn: str) -> bool:
    """``*`` matches exactly one dotted segment: ``model.layers.*.mlp`` matches ``model.layers.3.mlp`` only."""
    from fnmatch import fnmatchcase

    p, f = pattern.split("."), fqn.split(".")
    return len(p) == len(f) and all(fnmatchcase(b, a) for a, b in zip(p, f))
