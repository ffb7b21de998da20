"""Random weights at the released shapes, filled where a checkpoint's tensors would load (benchmarks).

``omni-run bench --full-size-layers N`` measures the released widths with
``N`` decoder layers and no checkpoint: ``build_pipeline(..., random_layers=N)``
builds exactly as for a checkpoint (meta modules, each layer given storage,
filled, prepared for its kernels, parked as the recipe's offload says; the
recipe's capture, KV pool and VAE) with these values in place of the load.
Norm weights are 1, biases 0, matrices ~N(0, 1/fan_in), so activations stay
O(1) through the layers; the tokenizer is the embedded tiny one (its ids are
valid rows of the released vocabulary). Images are noise.
"""
from __future__ import annotations

import dataclasses

import torch

from .config import HunyuanImage3Config


def released_layers(n: int) -> HunyuanImage3Config:
    """Every released width, ``n`` decoder layers (per-layer lists cut to ``n``)."""
    cfg = HunyuanImage3Config.released()
    per_layer = {k: getattr(cfg, k)[:n] for k in ("moe_topk", "moe_intermediate_size", "num_shared_expert")}
    return dataclasses.replace(cfg, num_hidden_layers=n, **per_layer)


def init_param_(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    """Norm weights 1, biases 0, matrices ~N(0, 1/fan_in) (stacked experts: the fan-in of one expert)."""
    if p.dim() == 1:
        p.fill_(1.0 if name.endswith("weight") else 0.0)
    else:
        fan_in = p[0].numel() if p.dim() == 2 or "experts" not in name else p[0, 0].numel()
        p.normal_(0.0, fan_in ** -0.5, generator=g)


@torch.no_grad()
def random_init_(module: torch.nn.Module, seed: int = 0, *, skip: tuple[str, ...] = ()) -> None:
    """Fill every parameter of ``module`` (those under a ``skip`` prefix excepted) with ``init_param_``'s values."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if not name.startswith(skip) and p.is_floating_point() and p.element_size() > 1:
            init_param_(name, p, g)
