"""The released HunyuanImage-3.0 shapes with random weights, for benchmarks (no checkpoint needed).

``released_layers(n)`` keeps every released width (hidden 4096, 32/8 heads,
64 experts top-8, expert dim 3072, vocab 133120) but only ``n`` decoder
layers; per-layer figures extrapolate linearly to 32 layers.
"""
from __future__ import annotations

import torch

from omni.build_options import BuildOptions
from omni.layers import finalize_all
from omni.models.hunyuan_image3.config import HunyuanImage3Config
from omni.models.hunyuan_image3.random_weights import init_param_ as _init_param_, random_init_, released_layers
from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer

__all__ = ["build_random_model", "build_random_model_layerwise", "random_init_", "released_layers"]


@torch.no_grad()
def _materialize_(module: torch.nn.Module, device, seed: int) -> None:
    """Give ``module``'s still-meta parameters device storage and random values."""
    g = torch.Generator(device=device).manual_seed(seed)
    for prefix, sub in module.named_modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:  # meta storage cannot be swapped in place: a new Parameter
                sub._parameters[name] = new = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                _init_param_(f"{prefix}.{name}", new, g)


def build_random_model_layerwise(cfg: HunyuanImage3Config, platform, *, dtype=torch.bfloat16, quant="none", paged=True,
                                 page_size=256, device="cuda", progress=None) -> HunyuanImage3Transformer:
    """As ``build_random_model``, but built on ``meta`` and materialized, quantized one layer at a time.

    Peak memory is the quantized model plus one layer in ``dtype``: the 32-layer FP8 model
    (~81 GiB) builds on one 141 GiB card, where 32 bf16 layers (~160 GiB) would not fit first.
    """
    with torch.device("meta"):
        model = HunyuanImage3Transformer(cfg, platform, BuildOptions(dtype=dtype, quant=quant, paged_kv=paged,
                                                                     page_size=page_size if paged else 0))
    for i, layer in enumerate(model.model.layers):
        _materialize_(layer, device, seed=i)
        finalize_all(layer)  # quantized now: the bf16 copy of this layer is freed before the next
        if progress is not None:
            progress(i)
    _materialize_(model, device, seed=cfg.num_hidden_layers)
    model.finalize()
    return model.eval()


def build_random_model(n_layers: int, platform, *, dtype=torch.bfloat16, quant="none", paged=True,
                       page_size=256, device="cuda") -> HunyuanImage3Transformer:
    cfg = released_layers(n_layers)
    with torch.device(device):
        model = HunyuanImage3Transformer(cfg, platform, BuildOptions(dtype=dtype, quant=quant, paged_kv=paged,
                                                                     page_size=page_size if paged else 0))
    random_init_(model)
    model.finalize()
    return model.eval()
