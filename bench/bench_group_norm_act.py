"""The one-pass "GroupNorm [, FiLM], SiLU" kernel (the cuda glue's ``group_norm``) and the channels-last VAE
decoder against the torch ops they replace, in the same run, at the released shapes (random weights).

- image heads of one CFG step (``patch_embed`` on one latent, ``final_layer`` on both rows, NHWC weights as
  the model keeps them on cuda): torch ops vs the kernel;
- the 1024x1024 VAE decode under fp16 autocast (the ``h200_*`` recipes'): NCDHW + torch ops (before),
  channels-last only, the kernel only, both (what ``AutoencoderKLConv3D.prepare`` gives on cuda).

Each figure is a CUDA-event median; the variants alternate in rounds. Outputs are compared with the first
variant's (largest difference, share of values that differ) and, for the VAE, with an fp32 decode in uint8
levels (PSNR).

    python bench/bench_group_norm_act.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_event_median, emit, git_commit  # noqa: E402
from bench_group_norm import heads  # noqa: E402
from random_fullsize import random_init_  # noqa: E402

from omni.group_norm import use_group_norm_kernel  # noqa: E402
from omni.models.hunyuan_image3 import image_io  # noqa: E402
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.specs import GlueSpec  # noqa: E402


def heads_with(platform, kernel):
    """One step's image heads (``bench_group_norm.heads``) with NHWC weights, as the model keeps them on cuda,
    and ``kernel`` as their GroupNorm's (None: the torch ops)."""
    def prepare(down, up):
        image_io.to_channels_last(down, up)
        if kernel is not None:
            use_group_norm_kernel(kernel, down, up)
    return heads(platform, prepare)


def vae_variants(kernel) -> dict:
    """(name -> decode function): an fp32 decode, then before, channels-last, the kernel, both (fp16 autocast).
    Two decoders with the same random values: one NCDHW, one channels-last (both resident)."""
    ncdhw, cl = (AutoencoderKLConv3D(VAEConfig(), with_encoder=False).to("cuda").eval() for _ in range(2))
    for vae in (ncdhw, cl):
        random_init_(vae, 0)
    cl.decoder.use_channels_last()
    lat = torch.randn(1, 32, 64, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))

    def decode(vae, fused: bool, dtype=torch.float16):
        def run():
            use_group_norm_kernel(kernel if fused else None, vae)
            return vae.decode_image(lat, dtype=dtype)
        return run

    return {"fp32": decode(ncdhw, False, torch.float32), "before (NCDHW, torch ops)": decode(ncdhw, False),
            "channels-last only": decode(cl, False), "kernel only": decode(ncdhw, True),
            "channels-last + kernel (landed)": decode(cl, True)}


def levels(x: torch.Tensor) -> torch.Tensor:
    return ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round()


def compare(fns: dict, iters: int, rounds: int, pixels: bool) -> dict:
    ref_name = next(iter(fns))
    outs = {n: f() for n, f in fns.items()}
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(cuda_event_median(f, iters, warmup=1))
    res = {}
    for n, y in outs.items():
        d = (y.float() - outs[ref_name].float()).abs()
        res[n] = {"ms": 1e3 * sorted(times[n])[len(times[n]) // 2], "max_abs_diff_vs_first": float(d.max()),
                  "frac_values_differ_vs_first": float((d > 0).float().mean())}
        if pixels:
            res[n]["max_level_diff_vs_first"] = float((levels(y) - levels(outs[ref_name])).abs().max())
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    platform = select("cuda")
    platform.device_services(0)
    kernel = platform.glue(GlueSpec(hidden=4096, head_dim=128, eps=1e-5, dtype=torch.bfloat16)).group_norm
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": git_commit()}
    with torch.inference_mode():
        out["image_heads_one_cfg_step"] = compare({"torch ops": heads_with(platform, None),
                                                   "kernel": heads_with(platform, kernel)}, 20, a.rounds, False)
        print(json.dumps({"image heads": out["image_heads_one_cfg_step"]}), flush=True)
        fns = vae_variants(kernel)
        ref32 = fns.pop("fp32")()
        res = compare(fns, 3, a.rounds, True)
        for n, f in fns.items():
            torch.cuda.reset_peak_memory_stats()
            px = f()
            res[n]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            mse = (levels(px) - levels(ref32)).pow(2).mean().item()
            res[n]["psnr_vs_fp32_db"] = 10 * torch.log10(torch.tensor(255.0**2 / max(mse, 1e-12))).item()
        out["vae_decode_1024_fp16"] = res
        print(json.dumps({"vae decode": res}), flush=True)
    return emit(out, a.json)


if __name__ == "__main__":
    sys.exit(main())
