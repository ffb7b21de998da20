"""Where a 1024x1024 VAE decode spends its kernel time: the released-shape VAE with random weights, one
decode under ``--dtype`` autocast (float16: the official pipeline's) profiled after two warm-up decodes.
The VAE is prepared as the engine prepares it on cuda (channels-last decoder, the glue's one-pass GroupNorm +
SiLU); ``--plain`` profiles the unprepared one (NCDHW, torch ops).

    python bench/profile_vae_decode.py --dtype float16 > out.log

Prints the kernel total, the launch count and the top kernels (device only: it profiles CUDA activity).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_fullsize import random_init_, released_layers  # noqa: E402

from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.specs import GlueSpec  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=list(DTYPES), default="float16")
    p.add_argument("--top", type=int, default=22)
    p.add_argument("--plain", action="store_true", help="NCDHW and torch ops (what ran before prepare)")
    a = p.parse_args()
    cfg = released_layers(1)
    with torch.device("cuda"):
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae)).eval()
    random_init_(vae, 0)
    if not a.plain:
        platform = select("cuda")
        platform.device_services(0)
        glue = platform.glue(GlueSpec(hidden=cfg.hidden_size, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                                      dtype=torch.bfloat16))
        vae.prepare(channels_last="channels_last" in platform.info.capabilities,
                    group_norm_kernel=getattr(glue, "group_norm", None))
    lat = torch.randn(1, cfg.latent_channels, 64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for _ in range(2):
        vae.decode_image(lat, dtype=DTYPES[a.dtype])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        vae.decode_image(lat, dtype=DTYPES[a.dtype])
        torch.cuda.synchronize()
    evs = sorted(((e.key, e.device_time_total, e.count) for e in prof.key_averages() if e.device_time_total > 0),
                 key=lambda e: -e[1])
    print(f"[vae profile] {'plain' if a.plain else 'prepared'} {a.dtype} decode kernels "
          f"{sum(e[1] for e in evs) / 1e3:.1f} ms in "
          f"{sum(e[2] for e in evs)} launches")
    for key, us, count in evs[:a.top]:
        print(f"   {us / 1e3:8.2f} ms x{count:<4d} {key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
