"""Editing cost at the released shapes: reference images through the ViT, the VAE encoder and the prefix.

One 1024x1024 request each: text-to-image (the baseline, same run), an edit
with one 1024px reference and an edit with three, all through the engine
exactly as serving runs them (``admit`` -> segmented ``prefill`` into the KV
pool -> cached denoising steps -> VAE decode), on the Instruct pipeline with
random weights: the released transformer widths with ``--layers`` of its 32
decoder layers, the released SigLIP2 (27 layers, 1024 patches) and aligner,
the released VAE with its encoder.

Measured per request (synchronized): ViT (aligner included), VAE encode
(posterior sample of every reference), prefix prefill (the backbone over the
prefix segments), one denoising step (after warm-up), decode, peak memory.
Transformer figures are extrapolated linearly to 32 layers: the step minus
its image I/O (patch embedding, final layer; measured separately) scales
with the layers, and so does the prefill; the output says which figures are.

    python bench/bench_edit.py --layers 8 --json bench/results/bench_edit_h200.json
"""
from __future__ import annotations

import argparse
import sys
import time
from importlib import resources
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402
from random_fullsize import build_random_model, random_init_, released_layers  # noqa: E402

from omni.build_options import BuildOptions  # noqa: E402
from omni.kv_pool import KVPool  # noqa: E402
from omni.parallel.runtime import SingleDevice  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.request import ImageRequest  # noqa: E402
from omni.step_engine import StepEngine  # noqa: E402
from omni.models.hunyuan_image3.instruct_pipeline import HunyuanImage3Instruct  # noqa: E402
from omni.models.hunyuan_image3.tokenizer import Tokenizer  # noqa: E402
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig  # noqa: E402
from omni.models.hunyuan_image3.vision import HunyuanVisionEncoder, VisionConfig  # noqa: E402

RELEASED_LAYERS = 32
PROMPT = "make the petals neon pink and keep the background"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--layers", type=int, default=8, help="decoder layers to build (released has 32)")
    p.add_argument("--size", type=int, default=1024, help="output and reference side in pixels")
    p.add_argument("--steps", type=int, default=3, help="timed denoising steps per request (after 2 warm-up)")
    p.add_argument("--total-steps", type=int, default=50, help="steps of the extrapolated total")
    p.add_argument("--kv-gib", type=float, default=8.0, help="KV pool budget")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def build(platform, dev, layers: int, kv_gib: float) -> StepEngine:
    """The Instruct engine over random released-shape modules (bf16 transformer and ViT, VAE under bf16)."""
    cfg = released_layers(layers)
    transformer = build_random_model(layers, platform, paged=False, device=dev.device)
    with torch.device(dev.device):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae)).eval()
        vision = HunyuanVisionEncoder(VisionConfig.from_model_config(cfg), platform, BuildOptions(dtype=torch.bfloat16))
    random_init_(vae)
    random_init_(vision)
    vision.finalize()
    asset = resources.files("omni.models.hunyuan_image3.assets") / "tiny_instruct_tokenizer.json"
    tok = Tokenizer.from_file(Path(str(asset)))  # ids only matter for length: any Instruct vocabulary does
    model = HunyuanImage3Instruct(vision=vision, transformer=transformer, vae=vae, tokenizer=tok, config=cfg,
                                  device=dev.device, vae_dtype=torch.bfloat16)
    pool = KVPool.from_budget(int(kv_gib * 2**30), num_layers=layers, page_size=256,
                              num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.bfloat16,
                              device=dev.device)
    return StepEngine(model, pool=pool, runtime=SingleDevice(), device=dev.device, paged=False)


def synced(dev, fn):
    """(result, seconds) of ``fn`` with the device drained before and after."""
    dev.synchronize()
    t0 = time.perf_counter()
    out = fn()
    dev.synchronize()
    return out, time.perf_counter() - t0


def image_io_s(dev, engine: StepEngine, state) -> float:
    """One step's patch embedding + final layer for the request's rows (what does not scale with layers)."""
    m, rows = engine.model, [r.seq for r in state.rows]
    fn = lambda: m.velocity(m.block_input(state.latents_1Chw, state.sigma, rows), rows, state.sigma)  # noqa: E731
    with torch.inference_mode():
        fn()
        return synced(dev, fn)[1]


def run_request(dev, engine: StepEngine, images, size: int, steps: int) -> dict:
    """One request through the engine; the reference encoders are also timed on their own."""
    req = ImageRequest(prompt=PROMPT, height=size, width=size, steps=50, guidance=5.0, seed=0, template="instruct",
                       images=images)
    m = engine.model
    dev.reset_peak_memory()
    resident = dev.max_memory_allocated()  # right after the reset: what is allocated now (weights, KV pool)
    with torch.inference_mode():
        vit_s = synced(dev, lambda: m.vision.encode(images))[1] if images else 0.0
        vae_s = synced(dev, lambda: m.reference_latents(images, torch.Generator().manual_seed(0)))[1] if images else 0.0
    state = engine.admit(req)
    prefill_s = synced(dev, lambda: engine.prefill([state]))[1]
    for _ in range(2):
        engine.denoise_step([state])
    step_s = synced(dev, lambda: [engine.denoise_step([state]) for _ in range(steps)])[1] / steps
    io_s = image_io_s(dev, engine, state)
    decode_s = synced(dev, lambda: engine.decode(state))[1]
    peak = dev.max_memory_allocated()
    out = {"references": len(images), "resident_gib": resident / 2**30,
           "prefix_tokens_per_row": state.rows[0].seq.prefix_len, "rows": len(state.rows),
           "step_tokens": sum(r.block_len for r in state.rows), "vit_s": vit_s, "vae_encode_s": vae_s,
           "prefill_s": prefill_s, "prefill_backbone_s": max(prefill_s - vit_s - vae_s, 0.0), "step_s": step_s,
           "image_io_s": io_s, "decode_s": decode_s, "peak_mem_gib": peak / 2**30}
    engine.release(state)
    return out


def extrapolate(r: dict, layers: int, total_steps: int) -> dict:
    """32-layer figures: transformer work scales with the layers; ViT, VAE and image I/O do not."""
    k = RELEASED_LAYERS / layers
    step = r["image_io_s"] + (r["step_s"] - r["image_io_s"]) * k
    prefill = r["prefill_backbone_s"] * k
    total = r["vit_s"] + r["vae_encode_s"] + prefill + total_steps * step + r["decode_s"]
    return {"step_s_32_layers_extrapolated": step, "prefill_backbone_s_32_layers_extrapolated": prefill,
            f"total_s_{total_steps}_steps_32_layers_extrapolated": total}


def main() -> int:
    a = parse()
    commit = git_commit()
    platform = select(a.platform)
    dev = platform.device_services(0)
    engine = build(platform, dev, a.layers, a.kv_gib)
    rng = np.random.default_rng(0)
    refs = tuple(rng.integers(0, 256, (a.size, a.size, 3), dtype=np.uint8) for _ in range(3))
    run_request(dev, engine, refs[:1], a.size, 1)  # warm-up: kernels, autotuning, allocator
    results = {}
    for name, images in (("t2i", ()), ("edit_1ref", refs[:1]), ("edit_3ref", refs)):
        r = run_request(dev, engine, images, a.size, a.steps)
        results[name] = {**r, **extrapolate(r, a.layers, a.total_steps)}
    base = results["t2i"]["step_s"]
    for r in results.values():
        r["step_vs_t2i"] = r["step_s"] / base
    out = {"commit": commit, "platform": platform.name, "device": platform.info.device_name, "layers": a.layers,
           "note": f"transformer at {a.layers} of {RELEASED_LAYERS} layers, random weights; *_extrapolated scale it",
           "size": a.size, "attention_kernels": {m: k.name for m, k in
                                                 engine.model.transformer.model.layers[0].self_attn.attn.items()},
           "results": results}
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
