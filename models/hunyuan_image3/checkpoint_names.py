"""Checkpoint names of the HunyuanImage-3.0 transformer: official names in, this module's parameters out.

Parameter names equal the official ones except for the MoE: the routed experts are stacked, so
``mlp.experts.{e}.gate_and_up_proj.weight`` [2I, D] is row ``e`` of ``mlp.experts.gate_and_up_proj.weight``
[E, 2I, D] (same for ``down_proj`` and a pre-quantized checkpoint's ``weight_scale`` / ``input_scale``). With
``kernels.fuse_shared_expert`` a layer has no ``shared_mlp``: its tensors are the stack's last group, E.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterator, Mapping

import torch
import torch.nn as nn

from omni.weights import LoadTarget, load_state_dict

if TYPE_CHECKING:
    from .transformer import HunyuanImage3Transformer

FOREIGN_PREFIXES = ("vae.", "vision_model.", "vision_aligner.")  # checkpoint parts other modules own
_LEAF = r"(weight|weight_scale|input_scale)"
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_and_up_proj|down_proj)\.weight")
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_and_up_proj|down_proj)\." + _LEAF)
_SHARED = re.compile(r"(model\.layers\.\d+\.mlp)\.shared_mlp\.(gate_and_up_proj|down_proj)\." + _LEAF)


def _shared_is_fused(model: HunyuanImage3Transformer, name: str) -> bool:
    """Whether the layer ``name`` (``model.layers.{i}....``) runs its shared expert as the stack's last group."""
    return model.model.layers[int(name.split(".")[2])].mlp.shared_mlp is None


def official_names(model: HunyuanImage3Transformer) -> Iterator[str]:
    """Every checkpoint name ``model`` owns (per-expert names for the stacked experts)."""
    for name, _ in model.named_parameters():
        stacked = _STACKED.fullmatch(name)
        if stacked is None:
            yield name
            continue
        yield from (f"{stacked[1]}.{e}.{stacked[2]}.weight" for e in range(model.cfg.num_experts))
        if _shared_is_fused(model, name):
            yield f"{stacked[1].removesuffix('.experts')}.shared_mlp.{stacked[2]}.weight"


def param_name_for(model: HunyuanImage3Transformer, official_name: str) -> tuple[str, int | None]:
    """(``model``'s parameter, index into its stacked expert dim or None) for a checkpoint name."""
    per_expert = _PER_EXPERT.fullmatch(official_name)
    if per_expert is not None:
        return f"{per_expert[1]}.{per_expert[3]}.{per_expert[4]}", int(per_expert[2])
    shared = _SHARED.fullmatch(official_name)
    if shared is not None and _shared_is_fused(model, official_name):
        return f"{shared[1]}.experts.{shared[2]}.{shared[3]}", model.cfg.num_experts
    if official_name.startswith(FOREIGN_PREFIXES) or not _has_param(model, official_name):
        raise KeyError(f"{official_name!r} is not a parameter of HunyuanImage3Transformer")
    return official_name, None


def _has_param(module: nn.Module, name: str) -> bool:
    """A parameter, or a declared checkpoint scale buffer (``weight_scale`` / ``input_scale``)."""
    owner, _, leaf = name.rpartition(".")
    try:
        sub = module.get_submodule(owner)
    except AttributeError:
        return False
    if leaf in dict(sub.named_parameters(recurse=False)):
        return True
    return leaf in ("weight_scale", "input_scale") and getattr(sub, leaf, None) is not None


def load_state(model: HunyuanImage3Transformer, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors (official names) into ``model``; ``vae.``/``vision_*`` keys are skipped.

    Raises ``CheckpointError`` (a ValueError) listing every missing, unexpected
    and mis-shaped key, with both shapes.
    """
    load_state_dict(tensors, [LoadTarget("", model, model.param_name_for)], skip_prefixes=FOREIGN_PREFIXES)
