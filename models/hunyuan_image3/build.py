"""Build a ready pipeline from a recipe: config -> modules -> weights -> kernels -> KV pool."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from omni import model_registry, quant
from omni.build_options import DTYPES, BuildOptions
from omni.kv_pool import KVPool
from omni.parallel.runtime import SingleDevice
from omni.step_engine import StepEngine
from omni.step_graphs import StepGraphs
from omni.vae_tiling import TileLanes
from omni.layers import finalize_all
from omni.offload import ALL, EXPERTS_ONLY, LayerOffloader, park_on_host
from omni.phase_clock import PhaseClock
from omni.weights import LoadTarget, StreamingLoad, materialize_meta_

from .config import HunyuanImage3Config
from .instruct_pipeline import HunyuanImage3Instruct, HunyuanImage3InstructDistil
from .parallel import plans_for
from .pipeline import HunyuanImage3T2I
from .random_weights import random_init_, released_layers
from .tiny import ensure_tiny_checkpoint
from .tokenizer import Tokenizer
from .transformer import HunyuanImage3Transformer
from .vae import AutoencoderKLConv3D, VAEConfig
from .vision import SKIPPED as VISION_UNUSED, HunyuanVisionEncoder, VisionConfig

log = logging.getLogger("omni.hunyuan_image3")
# Image understanding / editing inputs are not used by text-to-image, nor is the VAE encoder.
T2I_UNUSED = ("vision_model.", "vision_aligner.", "vae.encoder.")
EMBEDDED = {"hunyuan_image3_tiny": "trained", "hunyuan_image3_tiny_random": "base",
            "hunyuan_image3_instruct_tiny": "instruct_trained",
            "hunyuan_image3_instruct_tiny_random": "instruct"}  # flavour -> tiny kind


def checkpoint_dir(recipe, override: str | None, cache_dir: Path | None = None) -> Path:
    path = override or recipe.model.path
    if path:
        return Path(path)
    if recipe.model.flavor not in EMBEDDED:
        raise ValueError(f"recipe {recipe.name!r}: model.path is required for flavor {recipe.model.flavor!r}")
    return ensure_tiny_checkpoint(cache_dir, kind=EMBEDDED[recipe.model.flavor])


def random_release(flavor: str, layers: int, cache_dir: Path | None = None) -> tuple[Path, HunyuanImage3Config, bool]:
    """(tokenizer directory, config, instruct) of a random-weight build of ``flavor``'s architecture at the
    released widths with ``layers`` decoder layers (``omni-run bench --full-size-layers``): base, Instruct and
    Instruct-Distil share their shapes; Instruct adds the VAE and vision encoders, Distil the guidance and
    timestep_r embeddings. The tokenizer is the embedded tiny one of the same era (its ids are valid rows of
    the released vocabulary; the Instruct one spells the Distil tokens)."""
    f = model_registry.get(flavor)
    cfg = released_layers(layers)
    if f.distil:
        cfg = dataclasses.replace(cfg, cfg_distilled=True, use_meanflow=True)
    return ensure_tiny_checkpoint(cache_dir, kind="instruct_trained" if f.instruct else "base"), cfg, f.instruct


def is_instruct(root: Path) -> bool:
    """An Instruct-era checkpoint (its config.json names the version): it edits and needs the vision parts."""
    return "instruct" in str(json.loads((root / "config.json").read_text()).get("model_version", "")).lower()


def build_transformer(cfg: HunyuanImage3Config, platform, opts: BuildOptions, *, device="cpu",
                      parallel=None) -> tuple[HunyuanImage3Transformer, LoadTarget]:
    """The transformer on ``device`` and the load target that fills it.

    With ``parallel`` (an ``omni.parallel.runtime.ParallelRuntime``) the model
    is built on the meta device, cut to this rank's shard by the plan in
    ``parallel.py``, then allocated; its load target reads only this rank's
    slices of the checkpoint.
    """
    refusal = parallel.capture_refusal() if opts.capturable and parallel is not None else None
    if refusal:  # graph.mode: capture records the denoising step; tp and cfg layouts can, ep and sp cannot
        raise ValueError(f"graph.mode=capture: {refusal}; use graph.mode=eager")
    if parallel is None:
        with torch.device(device):
            model = HunyuanImage3Transformer(cfg, platform, opts)
        return model.eval(), LoadTarget("", model, model.param_name_for)
    with torch.device("meta"):  # nothing is allocated before every module has its local size
        model = HunyuanImage3Transformer(cfg, platform, opts)
        plan = parallel.shard_model(model, plans_for(opts.fuse_shared_expert), cfg=cfg, opts=opts)
    materialize_meta_(model, device)  # not ``to_empty``: it imports sympy on the way (``materialize_meta_``)
    model.requires_grad_(False)
    return model.eval(), plan.load_target()


def build_modules(cfg: HunyuanImage3Config, platform, recipe, device, parallel=None, instruct: bool = False):
    """(transformer, VAE, vision encoder or None, the transformer's load target).

    The VAE encoder and the vision encoder exist only for Instruct
    checkpoints (reference images); both are replicated on every rank.
    """
    opts = BuildOptions.from_recipe(recipe)
    model, target = build_transformer(cfg, platform, opts, device=device, parallel=parallel)
    with torch.device(device):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae), with_encoder=instruct)
        vision = HunyuanVisionEncoder(VisionConfig.from_model_config(cfg), platform, opts) if instruct else None
    return model, vae.eval(), vision, target


def _targets(target: LoadTarget, vae, vision) -> tuple[list[LoadTarget], tuple[str, ...]]:
    """Where each checkpoint prefix loads, and the prefixes this build skips unread."""
    targets = [target, LoadTarget("vae.", vae)]
    if vision is None:
        return targets, T2I_UNUSED
    targets += [LoadTarget("vision_model.", vision.vision_model), LoadTarget("vision_aligner.", vision.vision_aligner)]
    return targets, VISION_UNUSED


def prequantized(root: Path, recipe, model) -> str | None:
    """A pre-quantized checkpoint's scheme (its scale buffers declared on ``model``); refuses a mismatch."""
    scheme = quant.checkpoint_scheme(root)
    refusal = quant.checkpoint_refusal(scheme, recipe.quant.scheme)
    if refusal is not None:
        raise ValueError(f"{root}: {refusal}")
    if scheme is not None and recipe.quant.experts_only:  # its dense e4m3 weights would load without their scales
        raise ValueError(f"{root}: a pre-quantized {scheme} checkpoint sets the precision of every layer it "
                         "quantized; quant.experts_only=true cannot keep them in model.dtype (set it to false)")
    if scheme is not None:
        log.info("pre-quantized %s checkpoint: %d layers take its scales", scheme, model.prepare_prequantized())
    return scheme


STREAMED = {"layers": ALL, "experts": EXPERTS_ONLY}


def load_weights(recipe, cfg, platform, root: Path, services, parallel, progress: bool, instruct: bool = False,
                 random_values: bool = False, *, clock: PhaseClock):
    """The loaded, prepared transformer, VAE and vision encoder (or None), placed as ``offload.mode`` says,
    and their offloaders (``random_values``: ``random_weights``' values where the checkpoint's would load).

    Never the whole model in memory anywhere: the model is built on ``meta``
    (cut to this rank's shard under ``parallel``); each decoder layer in turn
    is given device storage, loaded, prepared (quantized on the device) and,
    for ``offload.mode`` layers / experts past ``resident_layers``, has its
    streamed tensors parked in pinned host memory. Peak device memory is the
    resident part plus one layer in the checkpoint's dtype, so the FP8 model
    loads on a card that could not hold it in bf16; host memory holds only
    what is streamed, already quantized. ``clock`` times the phases: "modules" includes resolving the
    platform's kernels (compiles at build, self-tests of compiled objects), and the first layer is timed apart
    from the others, since the first use of a kernel may cost more.
    """
    o, dev, keep = recipe.offload, services.device, STREAMED.get(recipe.offload.mode)
    with clock.phase("modules"):
        model, vae, vision, target = build_modules(cfg, platform, recipe, "meta", parallel, instruct)
        fill, finish = (_random_source(model, vae, vision) if random_values
                        else _checkpoint_source(root, recipe, model, target, vae, vision))
    layers = list(model.model.layers)
    for i, layer in enumerate(tqdm(layers, desc="loading layers", disable=not progress, leave=False)):
        with clock.phase("first layer" if i == 0 else "other layers"):
            materialize_meta_(layer, dev)
            fill(i, layer)
            finalize_all(layer)
            if keep is not None and i >= o.resident_layers:
                park_on_host(layer, services, keep)
    with clock.phase("outside the layers"):
        _finish_outside_layers(model, vae, vision, finish, dev)
    # The layer-by-layer load leaves its freed temporaries (a layer in the checkpoint's dtype, quantization
    # scratch) cached in the allocator: 10.7-15.4 GiB on the H200 at 32 layers. Return them before the KV pool is
    # allocated and graphs are captured, so other processes and allocations outside the cache see them
    # (BENCHMARKS.md, twenty-fourth session).
    services.empty_cache()
    return model, vae, vision, _offloaders(recipe, model, vae, services)


def _finish_outside_layers(model, vae, vision, finish, dev) -> None:
    """The embeddings, heads, VAE and vision encoder given storage, filled and prepared."""
    for m in (model, vae, vision):
        if m is not None:
            materialize_meta_(m, dev)
    finish()
    model.finalize()
    if vae is not None:
        vae.prepare(channels_last=model.channels_last, group_norm_kernel=model.group_norm_kernel)
    if vision is not None:
        vision.finalize()


def _checkpoint_source(root: Path, recipe, model, target, vae, vision):
    """(fill layer i, fill the rest): the checkpoint's tensors, streamed shard by shard."""
    prequantized(root, recipe, model)
    targets, skipped = _targets(target, vae, vision)
    stream = StreamingLoad(root, targets, skip_prefixes=skipped)
    return (lambda i, layer: stream.load(lambda key, prefix=f"model.layers.{i}.": key.startswith(prefix)),
            stream.finish)


def _random_source(model, vae, vision):
    """(fill layer i, fill the rest): random values (``random_weights``), layer i seeded with i."""
    def finish():
        random_init_(model, seed=len(model.model.layers), skip=("model.layers.",))
        for m in (vae, vision):
            if m is not None:
                random_init_(m, seed=0)
    return (lambda i, layer: random_init_(layer, seed=i)), finish


KEY_BUCKET = 1024  # tokens: prompts whose keys round up to the same multiple share a captured step
TEXT_GRAPHS = 8  # decode graphs kept (row buckets x key buckets seen lately); on the H200 at 32 layers the reserved
# memory stayed at 101.78-102.80 GiB while they were captured and evicted (BENCHMARKS.md, fourteenth session)


def key_bucket(model) -> int:
    """``KEY_BUCKET`` when the step's attention reads lengths on the device only (prompt lengths then share
    captured steps), else 0 (one graph per prompt-length set)."""
    attn = model.model.layers[0].self_attn.attn["none"]
    return 0 if getattr(attn, "reads_host_lengths", True) else KEY_BUCKET


def text_graphs(platform, device_type: str, model, runtime) -> StepGraphs | None:
    """The decode steps of text rows (answers, CoT passes) recorded per row bucket and key bucket; None where
    the attention reads host lengths (every token would be a new graph: those steps stay eager)."""
    bucket = key_bucket(model)
    if not bucket:
        log.info("text decode steps stay eager: the attention reads host lengths (one graph per token)")
        return None
    return StepGraphs(platform, device_type, name="text_decode", max_graphs=TEXT_GRAPHS, key_bucket=bucket,
                      collectives=runtime.step_collectives)


def _offloaders(recipe, model, vae, services) -> list[LayerOffloader]:
    o = recipe.offload
    if o.mode in STREAMED:
        return [LayerOffloader(list(model.model.layers), services, resident=o.resident_layers,
                               window=o.prefetch_window, keep=STREAMED[o.mode])]
    if o.mode == "vae":  # the decoder streams in once per decode (the encoder, Instruct only, stays)
        return [LayerOffloader([vae.decoder], services, window=1)]
    if o.mode == "text":  # embedding rows gathered on the host; lm_head runs there (text path only)
        for m in (model.model.wte, model.lm_head):
            park_on_host(m, services)
    return []


def build_pipeline(recipe, platform, *, model_path: str | None = None, local_rank: int = 0,
                   progress: bool = True, cache_dir: Path | None = None, parallel=None,
                   random_layers: int = 0) -> StepEngine:
    """Everything one worker needs to generate images for ``recipe`` on ``platform``.

    ``parallel``: this worker's ``omni.parallel.runtime.ParallelRuntime`` when
    the recipe spreads the model over several ranks (built by the launcher).
    ``random_layers``: no checkpoint; the released text-to-image shapes with
    that many decoder layers and random values, built the same way (benchmarks).
    """
    clock = PhaseClock()
    with clock.phase("device"):
        services = _bind_device(recipe, platform, local_rank)
    clock.sync = services.synchronize  # each phase then includes the device work it queued
    if random_layers:
        root, cfg, instruct = random_release(recipe.model.flavor, random_layers, cache_dir)
    else:
        root = checkpoint_dir(recipe, model_path, cache_dir)
        cfg, instruct = HunyuanImage3Config.from_file(root / "config.json"), is_instruct(root)
    model, vae, vision, offloaders = load_weights(recipe, cfg, platform, root, services, parallel, progress, instruct,
                                                  random_values=bool(random_layers), clock=clock)
    runtime = SingleDevice() if parallel is None else parallel
    with clock.phase("KV pool"):
        pool = _kv_pool(recipe, cfg, model, runtime, services.device)
    with clock.phase("engine"):
        t2i = _step_model(recipe, cfg, root, model, vae, vision, services.device, instruct)
        engine = _step_engine(recipe, platform, t2i, pool, runtime, services, offloaders)
    log.info("pipeline ready in %s: %s on %s, %d KV pages of %d tokens", clock.summary(), root, services.device,
             pool.num_pages, pool.page_size)
    return engine


def _bind_device(recipe, platform, local_rank: int):
    """This worker's device services, set before the first tensor lands on the device: expandable segments and
    the ``device.memory_limit_gib`` cap where the recipe asks."""
    services = platform.device_services(local_rank)
    if recipe.device.expandable_segments:
        log.info("expandable allocator segments: %s", services.expandable_segments())
    if recipe.device.memory_limit_gib:  # a share of the card: the allocator refuses to grow past it
        fraction = services.limit_memory(int(recipe.device.memory_limit_gib * 2**30))
        log.info("device memory capped at %g GiB (%.0f%% of the card)", recipe.device.memory_limit_gib, 100 * fraction)
    return services


def _kv_pool(recipe, cfg: HunyuanImage3Config, model, runtime, device) -> KVPool:
    """The paged KV cache ``kv_cache.budget_bytes`` buys, with the KV heads this worker keeps."""
    return KVPool.from_budget(recipe.kv_cache.budget_bytes, num_layers=cfg.num_hidden_layers,
                              page_size=recipe.kv_cache.page_tokens,
                              num_kv_heads=runtime.pool_kv_heads(cfg.num_key_value_heads, cfg.num_attention_heads),
                              head_dim=cfg.head_dim, dtype=DTYPES[recipe.model.dtype], device=device,
                              store_gather=model.kv_store_gather)


def _step_model(recipe, cfg: HunyuanImage3Config, root: Path, model, vae, vision, device, instruct: bool):
    """The ``StepModel`` of this checkpoint's era: text-to-image (base), Instruct, or Instruct-Distil."""
    kw = dict(transformer=model, vae=vae, tokenizer=Tokenizer.from_file(root / "tokenizer.json"), config=cfg,
              device=device, vae_dtype=DTYPES[recipe.model.vae_dtype])
    if not instruct:
        return HunyuanImage3T2I(**kw)
    cls = HunyuanImage3InstructDistil if cfg.cfg_distilled and cfg.use_meanflow else HunyuanImage3Instruct
    return cls(vision=vision, vae_encode_tile=_vae_tiles(recipe), **kw)


def _vae_tiles(recipe) -> tuple[int, int] | None:
    """``(tile, overlap)`` latents when ``vae.tiling`` is on; None runs the VAE whole."""
    return (recipe.vae.tile_latents, recipe.vae.overlap) if recipe.vae.tiling else None


def _step_engine(recipe, platform, t2i, pool: KVPool, runtime, services, offloaders) -> StepEngine:
    """The packed denoiser over ``t2i``, with the recipe's step cache and, under ``graph.mode: capture``, graphs
    for the step, the VAE decode and the text decode steps (refused there, with the platform's reasons, where
    it cannot capture)."""
    capture, device_type, model = recipe.graph.mode == "capture", services.device.type, t2i.transformer
    writes_text = isinstance(t2i, HunyuanImage3Instruct)  # answers and CoT passes: decode steps to capture
    return StepEngine(
        t2i, pool=pool, runtime=runtime, device=services.device, paged=recipe.kv_cache.mode == "paged",
        step_cache=recipe.step_cache.threshold if recipe.step_cache.enabled else 0.0,
        step_graphs=StepGraphs(platform, device_type, key_bucket=key_bucket(model),
                               collectives=runtime.step_collectives) if capture else None,
        synchronize=services.synchronize, to_host=services.to_host_async, memory_stats=services.memory_stats,
        vae_graphs=StepGraphs(platform, device_type, name="vae_decode",
                              max_graphs=2 * recipe.vae.streams) if capture else None,
        text_graphs=text_graphs(platform, device_type, model, runtime) if capture and writes_text else None,
        vae_tiles=_vae_tiles(recipe), vae_lanes=TileLanes(services, recipe.vae.streams), offloaders=offloaders,
        compile_scope=platform.compile_scope)
