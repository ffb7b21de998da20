"""GroupNorm at the released image shapes: torch's kernel vs ``omni.group_norm`` (same weights, same run).

Times the fp32 VAE decode of one 1024x1024 image (random released-shape VAE) and
the image heads of one CFG denoising step (``patch_embed`` on one latent,
``final_layer`` on both rows, random released widths), each once with every
GroupNorm computed by ``F.group_norm`` and once by ``omni.group_norm``; also the
largest difference between the two outputs. CUDA-event medians.

    python bench/bench_group_norm.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_event_median  # noqa: E402
from random_fullsize import random_init_  # noqa: E402

from omni import group_norm as gn  # noqa: E402
from omni.models.hunyuan_image3 import image_io  # noqa: E402
from omni.models.hunyuan_image3.config import HunyuanImage3Config  # noqa: E402
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig  # noqa: E402
from omni.platform_manager import select  # noqa: E402


@contextmanager
def torch_group_norm():
    """Every ``omni.group_norm`` call answered by ``F.group_norm`` (the kernel this replaces)."""
    saved = gn.group_norm, image_io.group_norm
    gn.group_norm = image_io.group_norm = F.group_norm
    try:
        yield
    finally:
        gn.group_norm, image_io.group_norm = saved


def both(fn, iters):
    with torch_group_norm():
        y_ref, t_ref = fn(), cuda_event_median(fn, iters)
    y, t = fn(), cuda_event_median(fn, iters)
    return {"torch_ms": t_ref * 1e3, "ours_ms": t * 1e3, "speedup": t_ref / t,
            "max_abs_diff": float((y.float() - y_ref.float()).abs().max())}


def heads(platform, prepare=None):
    """One CFG step's image heads at the released widths (random values); ``prepare(down, up)`` runs once after
    the values are set (a benchmark's layout or kernel choice)."""
    cfg = HunyuanImage3Config()
    kw = dict(patch_size=1, platform=platform, dtype=torch.bfloat16)
    with torch.device("cuda"):
        down = image_io.UNetDown(cfg.latent_channels, cfg.patch_embed_hidden_dim, cfg.hidden_size, **kw)
        up = image_io.UNetUp(cfg.hidden_size, cfg.patch_embed_hidden_dim, cfg.latent_channels, **kw)
    for m in (down, up):
        random_init_(m, 0)
    if prepare is not None:
        prepare(down, up)
    g = torch.Generator(device="cuda").manual_seed(0)
    lat = torch.randn(1, cfg.latent_channels, 64, 64, device="cuda", generator=g).bfloat16()
    emb1, emb2 = (torch.randn(n, cfg.hidden_size, device="cuda", generator=g).bfloat16() for n in (1, 2))
    h = torch.randn(2, 64 * 64, cfg.hidden_size, device="cuda", generator=g).bfloat16()

    def step():
        return torch.cat([down(lat, emb1).flatten(), up(h, emb2, 64, 64).flatten()])

    return step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    platform = select("cuda")
    platform.device_services(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.inference_mode():
        out["image_heads_one_cfg_step"] = both(heads(platform), 20)
        print(json.dumps({"image heads": out["image_heads_one_cfg_step"]}), flush=True)
        with torch.device("cuda"):
            vae = AutoencoderKLConv3D(VAEConfig()).eval()
        random_init_(vae, 0)
        lat = torch.randn(1, 32, 64, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        out["vae_decode_1024_fp32"] = both(lambda: vae.decode_image(lat), 5)
        print(json.dumps({"vae decode": out["vae_decode_1024_fp32"]}), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
