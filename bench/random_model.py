"""A whole text-to-image pipeline of the released shapes with random weights: no checkpoint needed.

The transformer is ``random_fullsize.build_random_model`` (every released
width, only ``num_layers`` decoder layers); this adds what the engine path
needs around it: the released VAE (random weights), the embedded tiny
tokenizer (its ids are valid rows of the released 133120-token vocabulary,
and it spells every special token the sequences use) and a KV pool sized by
the recipe. Images are noise; the point is the timing and memory of the
real shapes through the scheduler, the packed steps and the paged pool.

    pipeline = build_random_pipeline(load_recipe("h200_fp8"), select("cuda"), num_layers=4)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_fullsize import build_random_model, random_init_  # noqa: E402

from omni.build_options import DTYPES  # noqa: E402
from omni.kv_pool import KVPool  # noqa: E402
from omni.models.hunyuan_image3.pipeline import HunyuanImage3T2I  # noqa: E402
from omni.models.hunyuan_image3.tiny import ensure_tiny_checkpoint  # noqa: E402
from omni.models.hunyuan_image3.tokenizer import Tokenizer  # noqa: E402
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig  # noqa: E402
from omni.parallel.runtime import SingleDevice  # noqa: E402
from omni.step_engine import StepEngine  # noqa: E402


def build_random_pipeline(recipe, platform, *, num_layers: int, local_rank: int = 0,
                          seed: int = 0, model=None, vae_tiles: tuple[int, int] | None = None,
                          vae_lanes=None) -> StepEngine:
    """The released shapes with ``num_layers`` layers and random weights, set up as ``recipe`` says.

    ``model``: a transformer built already (``build_random_model_layerwise``); else one is built here.
    ``vae_tiles`` / ``vae_lanes``: tiled VAE decode, as ``StepEngine`` takes them.
    """
    services = platform.device_services(local_rank)
    device, dtype, paged = services.device, DTYPES[recipe.model.dtype], recipe.kv_cache.mode == "paged"
    model = model or build_random_model(num_layers, platform, dtype=dtype, quant=recipe.quant.scheme, paged=paged,
                                        page_size=recipe.kv_cache.page_tokens, device=device)
    cfg = model.cfg
    with torch.device(device):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae), with_encoder=False).eval()
    random_init_(vae, seed)
    pool = KVPool.from_budget(recipe.kv_cache.budget_bytes, num_layers=cfg.num_hidden_layers,
                              page_size=recipe.kv_cache.page_tokens, num_kv_heads=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, dtype=dtype, device=device)
    tokenizer = Tokenizer.from_file(ensure_tiny_checkpoint() / "tokenizer.json")
    t2i = HunyuanImage3T2I(transformer=model, vae=vae, tokenizer=tokenizer, config=cfg, device=device,
                           vae_dtype=DTYPES[recipe.model.vae_dtype])
    return StepEngine(t2i, pool=pool, runtime=SingleDevice(), device=device, paged=paged, vae_tiles=vae_tiles,
                      vae_lanes=vae_lanes)
