"""The real build path of an offload recipe on a checkpoint of the released shapes: streamed vs resident.

Writes a random checkpoint in the released layout (official names, per-expert
tensors, bf16, ``--layers`` decoder layers, the released VAE decoder, the
embedded tokenizer), then builds it twice through its deployment (``prepare(...).build_pipeline()``):

  resident   recipe ``--recipe`` with ``offload.mode: none`` (fp8, loaded whole, quantized on the device)
  streamed   the same recipe as written (``offload.mode: experts``): built on ``meta`` and loaded,
             quantized and parked one layer at a time (``omni.weights.StreamingLoad``), under the
             recipe's ``device.memory_limit_gib`` cap

and generates the same request with both. Reports build times, device memory
after each build and its peak, the bytes the offloader copied over the request
(prefill + steps, each forward streaming every offloaded layer),
and PSNR/SSIM between the two images (equal math; the CUDA MoE path is not
bitwise deterministic, so the images may differ in the last levels).

    python bench/smoke_streamed_build.py --layers 3 --json out.json
    python bench/smoke_streamed_build.py --platform cpu --config small --layers 3   # a dry run
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit  # noqa: E402

from omni.build_options import BuildOptions  # noqa: E402
from omni.deployment import prepare  # noqa: E402
from omni.engine import Engine  # noqa: E402
from omni.image_quality import psnr, ssim  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.recipe import load_recipe  # noqa: E402
from omni.request import ImageRequest  # noqa: E402
from omni.models.hunyuan_image3.config import HunyuanImage3Config  # noqa: E402
from omni.models.hunyuan_image3.tiny import TINY_CONFIG, _write_shards, official_tensors  # noqa: E402
from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer  # noqa: E402
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig  # noqa: E402

GiB = 2**30


def config_json(layers: int, small: bool) -> dict:
    """A config.json of the released widths (or small ones for a dry run) with ``layers`` decoder layers."""
    rel = HunyuanImage3Config.released()
    widths = dict(vocab_size=rel.vocab_size, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                  attention_head_dim=128, intermediate_size=3072, num_experts=64, patch_embed_hidden_dim=1024,
                  moe_inter=3072, topk=8, vae=dict(rel.vae))
    if small:
        widths.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=64,
                      intermediate_size=128, num_experts=8, patch_embed_hidden_dim=64, moe_inter=128, topk=2,
                      vae=TINY_CONFIG["vae"])
    inter, topk = widths.pop("moe_inter"), widths.pop("topk")
    return {**TINY_CONFIG, **widths, "num_hidden_layers": layers, "moe_intermediate_size": [inter] * layers,
            "moe_topk": [topk] * layers, "num_shared_expert": [1] * layers, "torch_dtype": "bfloat16"}


@torch.no_grad()
def write_checkpoint(root: Path, cfg_json: dict) -> float:
    """Random bf16 weights under official names (matrices ~N(0, 1/fan_in), norms 1); returns GiB written."""
    cfg = HunyuanImage3Config.from_json_dict(cfg_json)
    with torch.device("meta"):
        model = HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=torch.bfloat16))
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae), with_encoder=False)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in official_tensors({"": model, "vae.": vae}).items():
        if t.dim() == 1:
            tensors[name] = torch.ones(t.shape, dtype=torch.bfloat16) if name.endswith("weight") else \
                torch.zeros(t.shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(t.shape, generator=g) / t[0].numel() ** 0.5).to(torch.bfloat16)
    root.mkdir(parents=True, exist_ok=True)
    _write_shards(root, tensors)
    (root / "config.json").write_text(json.dumps(cfg_json))
    tok = resources.files("omni.models.hunyuan_image3.assets").joinpath("tiny_tokenizer.json")
    (root / "tokenizer.json").write_text(tok.read_text())
    return sum(t.numel() * t.element_size() for t in tensors.values()) / GiB


def run(recipe, platform, root: Path, steps: int) -> dict:
    dev = platform.device_services(0)
    dev.reset_peak_memory()
    t0 = time.perf_counter()
    pipe = prepare(recipe, platform=platform.name, overrides={"model.path": str(root)}).build_pipeline(progress=False)
    dev.synchronize()
    built = {"build_s": time.perf_counter() - t0, "build_peak_gib": dev.max_memory_allocated() / GiB,
             "device_gib_after_build": dev.memory_stats().get("allocated_bytes", 0) / GiB}
    out = Engine(pipe).run([ImageRequest(prompt="a red cat on green grass", steps=steps, seed=3)])[0]
    copied = sum(o.stats.bytes_copied for o in pipe.offloaders)
    image = torch.from_numpy(out.image_HW3)
    del pipe
    dev.empty_cache()
    return {**built, "denoise_s": out.times.denoise, "copied_gib_request": copied / GiB, "image": image}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--recipe", default="h200_lowmem")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--resident", type=int, default=1, help="offload.resident_layers of the streamed build")
    p.add_argument("--window", type=int, default=1, help="offload.prefetch_window of the streamed build")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--config", choices=["released", "small"], default="released")
    p.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temporary directory)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    platform = select(a.platform)
    root = a.dir or Path(tempfile.mkdtemp(prefix="omni-ckpt-"))
    t0 = time.perf_counter()
    gib = write_checkpoint(root, config_json(a.layers, a.config == "small"))
    out = {"device": platform.info.device_name, "layers": a.layers, "checkpoint_gib": gib,
           "write_s": time.perf_counter() - t0}
    streamed = load_recipe(a.recipe).replace_paths({"offload.resident_layers": a.resident,
                                                    "offload.prefetch_window": a.window})
    if platform.name == "cpu":  # a dry run: the cpu platform has no fp8 kernels of its own nor a memory cap
        streamed = dataclasses.replace(streamed, platform="cpu").replace_paths(
            {"device.memory_limit_gib": 0, "device.kind": "cpu"})
    runs = {"resident": streamed.replace_paths({"offload.mode": "none"}), "streamed": streamed}
    results = {name: run(r, platform, root, a.steps) for name, r in runs.items()}
    images = {name: r.pop("image") for name, r in results.items()}
    out.update(results)
    out["psnr_db"] = psnr(images["streamed"], images["resident"])
    out["ssim"] = ssim(images["streamed"], images["resident"])
    out["max_level_diff"] = int((images["streamed"].int() - images["resident"].int()).abs().max())
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return emit({k: (None if v == float("inf") else v) for k, v in out.items()}, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
