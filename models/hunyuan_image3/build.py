"""Build a ready pipeline from a recipe: config -> modules -> weights -> kernels -> KV pool."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from omni.kv_pool import KVPool
from omni.weights import LoadTarget, load_checkpoint

from .config import HunyuanImage3Config
from .parallel import PLANS
from .pipeline import HunyuanImage3Pipeline
from .tiny import ensure_tiny_checkpoint
from .tokenizer import Tokenizer
from .transformer import HunyuanImage3Transformer
from .vae import AutoencoderKLConv3D, VAEConfig

log = logging.getLogger("omni.hunyuan_image3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Image understanding / editing inputs are not used by text-to-image.
T2I_UNUSED = ("vision_model.", "vision_aligner.")


def checkpoint_dir(recipe, override: str | None, cache_dir: Path | None = None) -> Path:
    path = override or recipe.model.path
    if path:
        return Path(path)
    if recipe.model.flavor != "hunyuan_image3_tiny":
        raise ValueError(f"recipe {recipe.name!r}: model.path is required for flavor {recipe.model.flavor!r}")
    return ensure_tiny_checkpoint(cache_dir)


def build_transformer(cfg: HunyuanImage3Config, platform, *, dtype, quant: str = "none", paged_kv: bool = False,
                      page_size: int = 0, attn_backend: str = "auto", device="cpu",
                      parallel=None) -> tuple[HunyuanImage3Transformer, LoadTarget]:
    """The transformer on ``device`` and the load target that fills it.

    With ``parallel`` (an ``omni.parallel.runtime.ParallelRuntime``) the model
    is built on the meta device, cut to this rank's shard by the plan in
    ``parallel.py``, then allocated; its load target reads only this rank's
    slices of the checkpoint.
    """
    kw = dict(dtype=dtype, quant=quant, paged_kv=paged_kv, page_size=page_size, attn_backend=attn_backend)
    if parallel is None:
        with torch.device(device):
            model = HunyuanImage3Transformer(cfg, platform, **kw)
        return model.eval(), LoadTarget("", model, model.param_name_for)
    with torch.device("meta"):  # nothing is allocated before every module has its local size
        model = HunyuanImage3Transformer(cfg, platform, **kw)
        plan = parallel.shard_model(model, PLANS, cfg=cfg, module_kw=dict(platform=platform, **kw),
                                    kernel_kw=dict(dtype=dtype, paged=paged_kv, page_size=page_size,
                                                   backend=attn_backend))
    model.to_empty(device=device)
    model.requires_grad_(False)
    return model.eval(), plan.load_target()


def build_modules(cfg: HunyuanImage3Config, platform, recipe, device, parallel=None):
    paged = recipe.kv_cache.mode == "paged"
    model, target = build_transformer(cfg, platform, dtype=DTYPES[recipe.model.dtype], quant=recipe.quant.scheme,
                                      paged_kv=paged, page_size=recipe.kv_cache.page_tokens if paged else 0,
                                      attn_backend=recipe.attention.backend, device=device, parallel=parallel)
    with torch.device(device):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae))
    return model, vae.eval(), target


def build_pipeline(recipe, platform, *, model_path: str | None = None, local_rank: int = 0,
                   progress: bool = True, cache_dir: Path | None = None, parallel=None) -> HunyuanImage3Pipeline:
    """Everything one worker needs to generate images for ``recipe`` on ``platform``.

    ``parallel``: this worker's ``omni.parallel.runtime.ParallelRuntime`` when
    the recipe spreads the model over several ranks (built by the launcher).
    """
    services = platform.device_services(local_rank)
    root = checkpoint_dir(recipe, model_path, cache_dir)
    cfg = HunyuanImage3Config.from_file(root / "config.json")
    model, vae, target = build_modules(cfg, platform, recipe, services.device, parallel)
    load_checkpoint(root, [target, LoadTarget("vae.", vae)], skip_prefixes=T2I_UNUSED, progress=progress)
    model.finalize()
    kv_heads = cfg.num_key_value_heads if parallel is None else \
        parallel.pool_kv_heads(cfg.num_key_value_heads, cfg.num_attention_heads)
    pool = KVPool.from_budget(recipe.kv_cache.budget_bytes, num_layers=cfg.num_hidden_layers,
                              page_size=recipe.kv_cache.page_tokens, num_kv_heads=kv_heads,
                              head_dim=cfg.head_dim, dtype=DTYPES[recipe.model.dtype], device=services.device)
    log.info("pipeline ready: %s on %s, %d KV pages of %d tokens", root, services.device, pool.num_pages, pool.page_size)
    return HunyuanImage3Pipeline(model=model, vae=vae, tokenizer=Tokenizer.from_file(root / "tokenizer.json"),
                                 config=cfg, pool=pool, device=services.device,
                                 paged=recipe.kv_cache.mode == "paged", vae_dtype=DTYPES[recipe.model.vae_dtype],
                                 parallel=parallel)
