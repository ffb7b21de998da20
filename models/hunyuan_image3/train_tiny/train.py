"""Train the embedded default: the tiny VAE first, then the tiny transformer on its frozen latents.

The forward is the model's own: ``HunyuanImage3Transformer`` on the CPU
reference platform over the official full sequence (``build_t2i_pair``:
prefix text, ``<timestep>``, the image run; generalized-causal mask through
``DenseContext``, the golden tests' path), so the weights need nothing else
to run in the engine. Objective: the official sampler's flow matching,
x_sigma = (1 - sigma) x0 + sigma * noise, target velocity noise - x0, sigma
drawn through the sampler's shift. CFG dropout: ``DROP_P`` of the rows are
the unconditional row (every prompt token a ``<cfg>``).

The VAE's posterior mean is pinned to ``pinned_latent`` (see there), so the
transformer trains on latents computed without the encoder, and the two
phases are independent.

Resumable: every ``--save-every`` steps the modules, the optimizer moments
and the loss log go to ``OUT/state/`` (safetensors + JSON, ``checkpoint.py``);
``--resume`` continues from there, and the data of step s is a function of
(seed, s).

Shape suffixes: B rows, T packed tokens, D width, C latent channels, h/w latent grid.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from omni.attention_context import DenseContext, dense_meta
from omni.build_options import BuildOptions
from omni.platform_manager import select

from .. import tiny
from ..assets.make_tiny_tokenizer import build as build_tokenizer, trained_vocab
from ..config import HunyuanImage3Config
from ..rope import rope_cos_sin
from ..sequence import build_t2i_pair
from ..tokenizer import Tokenizer
from ..transformer import HunyuanImage3Transformer
from ..vae import AutoencoderKLConv3D, VAEConfig
from . import data

DROP_P = 0.1  # CFG dropout: share of unconditional rows
SHIFT = 3.0  # the recipe's sampler shift: train where the sampler spends its steps
LATENT_STD = 0.05  # posterior std the decoder is trained under (the KL term's smoothing role)
GROUP = 4  # rows per packed forward (one block-diagonal dense mask)


def pinned_latent(x_B3HW: torch.Tensor) -> torch.Tensor:
    """The latent the VAE is trained to: per 16x16 cell the mean RGB and the cell's colour spread (edges).

    Pinning the posterior mean to this cheap function (the encoder is trained
    to regress onto it) lets the transformer's targets be computed without
    running the encoder at 256x256 on every step, which the shared 2-core CPU
    could not afford; the decoder learns to draw from it.
    """
    mean_B3hw = F.avg_pool2d(x_B3HW, 16)
    spread_B1hw = (F.avg_pool2d(x_B3HW.square(), 16) - mean_B3hw.square()).clamp_min(0).sqrt().mean(1, keepdim=True)
    return torch.cat([mean_B3hw, 2 * spread_B1hw], dim=1)


def trained_config(vocab_size: int) -> dict:
    """The shipped config: the tiny family (2 layers, 4 experts) widened to hidden 128, drawing at 128x128."""
    return {**tiny.TINY_CONFIG, "vocab_size": vocab_size, "hidden_size": 128, "attention_head_dim": 32,
            "moe_intermediate_size": [64, 64], "image_base_size": data.SIZE}


def tokenizer_vocab() -> dict[str, int]:
    base = json.loads((Path(tiny.__file__).parent / "assets" / "tiny_tokenizer.json").read_text())["model"]["vocab"]
    return trained_vocab(base)


class Trainer:
    """The modules, their optimizers and the step counters of one run."""

    PARTS = ("vae", "dit")  # what checkpoint.save_state / load_state keep of this run

    def __init__(self, args):
        self.args, self.vocab = args, tokenizer_vocab()
        self.config = trained_config(len(self.vocab))
        self.tok = Tokenizer(build_tokenizer(self.vocab))
        torch.manual_seed(args.seed)
        cfg = HunyuanImage3Config.from_json_dict(self.config)
        self.model = HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=torch.float32))
        g = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                tiny._init_(name, p, g)
            self.model.final_layer.model[1][2].weight.zero_()  # start from a zero velocity
        self.vae = AutoencoderKLConv3D(VAEConfig.from_dict(self.config["vae"]))
        self.model.requires_grad_(True)
        self.vae.requires_grad_(True)
        self.opt_vae = torch.optim.AdamW(self.vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.01)
        self.step, self.vae_step, self.log = 0, 0, {"vae": [], "dit": []}
        self.scale = self.fit_scale()

    # ------------------------------------------------------------ VAE
    def vae_loss(self, x_B3HW: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Decoder: reconstruct from the pinned latent plus posterior noise; encoder: regress onto it."""
        target = pinned_latent(x_B3HW)
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + 7 + self.vae_step)
        z = target + LATENT_STD * torch.randn(target.shape, generator=g)
        recon = self.vae.decode(z.unsqueeze(2))[:, :, -1]
        rec = F.mse_loss(recon, x_B3HW) + 0.5 * F.l1_loss(recon, x_B3HW)
        mean, logvar = self.vae.encode(x_B3HW)
        enc = F.mse_loss(mean, target) + 0.01 * F.mse_loss(logvar, torch.full_like(logvar, 2 * math.log(LATENT_STD)))
        return rec + enc, rec.item()

    def train_vae_step(self) -> float:
        x, _ = data.batch(self.args.seed + 1, self.vae_step, self.args.vae_batch)
        loss, rec = self.vae_loss(torch.from_numpy(self.crop(x, self.args.vae_size)))
        self.opt_vae.zero_grad(set_to_none=True)
        loss.backward()
        self.opt_vae.step()
        self.vae_step += 1
        return rec

    def crop(self, x_B3HW, side: int):
        """Random ``side``-pixel crops (on the 16-pixel latent grid) of full-size images: the VAE is
        convolutional, so it learns the native-size statistics at a fraction of the cost."""
        rng = np.random.default_rng([self.args.seed + 3, self.vae_step])
        cells = (x_B3HW.shape[-1] - side) // 16 + 1
        out = []
        for img in x_B3HW:
            y0, x0 = 16 * rng.integers(cells, size=2)
            out.append(img[:, y0 : y0 + side, x0 : x0 + side])
        return np.stack(out)

    def latents(self, x_B3HW: torch.Tensor) -> torch.Tensor:
        """The pipeline's latents: the (pinned) posterior mean times scaling_factor, as ``encode_image``."""
        return pinned_latent(x_B3HW) * self.scale

    def fit_scale(self) -> float:
        """scaling_factor = 1 / std of the latents (unit variance for the flow objective)."""
        x, _ = data.batch(self.args.seed + 2, 0, 256)
        return 1.0 / pinned_latent(torch.from_numpy(x)).std().item()

    # ------------------------------------------------------------ transformer
    def rows(self, captions: list[str], g: torch.Generator) -> list:
        drop = torch.rand(len(captions), generator=g) < DROP_P
        return [build_t2i_pair(self.tok, c, template="pretrain", height=data.SIZE, width=data.SIZE,
                               downsample=16, base_size=data.SIZE)[int(d)] for c, d in zip(captions, drop)]

    def velocity(self, rows, xt_BChw: torch.Tensor, sigma_B: torch.Tensor) -> torch.Tensor:
        """The model's velocity for packed rows: [prefix; <timestep>; image] each, one dense forward."""
        t_B = sigma_B * 1000.0
        img_BLD, ts_BD = self.model.image_tokens(xt_BChw, t_B), self.model.timestep_token(t_B)
        parts, masks, pos = [], [], []
        for i, row in enumerate(rows):
            n = row.image_slice.stop  # the trailing <eoi> is causal after the image: it changes nothing before it
            parts += [self.model.embed_tokens(torch.tensor(row.ids[: row.prefix_len])), ts_BD[i : i + 1], img_BLD[i]]
            masks.append(row.attention_mask()[:n, :n])
            pos += row.pos_yx[:n]
        cos_TH, sin_TH = rope_cos_sin(torch.tensor(pos), self.model.cfg.head_dim, self.model.cfg.rope_theta)
        h_TD = self.model.backbone(torch.cat(parts), cos_TH, sin_TH, DenseContext(dense_meta(torch.block_diag(*masks))))
        ends = torch.tensor([r.image_slice.stop for r in rows]).cumsum(0)
        h_BnD = torch.stack([h_TD[e - xt_BChw.shape[2] * xt_BChw.shape[3] : e] for e in ends.tolist()])
        return self.model.velocity(h_BnD, t_B, xt_BChw.shape[2], xt_BChw.shape[3])

    def train_step(self) -> float:
        x, captions = data.batch(self.args.seed, self.step, self.args.batch)
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.step)
        x0 = self.latents(torch.from_numpy(x))
        xt, sigma, target = noised(x0, g)
        rows = self.rows(captions, g)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for s in range(0, len(rows), GROUP):
            v = self.velocity(rows[s : s + GROUP], xt[s : s + GROUP], sigma[s : s + GROUP])
            loss = F.mse_loss(v, target[s : s + GROUP]) * v.shape[0] / len(rows)
            loss.backward()
            total += loss.item()
        optimizer_step(self.opt, self.model.parameters(), self.args, self.step)
        self.step += 1
        return total


def noised(x0_BChw: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_sigma, sigma_B, target velocity) of the official flow matching; noise, then sigma, drawn from ``g``."""
    noise = torch.randn(x0_BChw.shape, generator=g)
    u = torch.rand(x0_BChw.shape[0], generator=g)
    sigma_B = SHIFT * u / (1 + (SHIFT - 1) * u)
    s = sigma_B[:, None, None, None]
    return (1 - s) * x0_BChw + s * noise, sigma_B, noise - x0_BChw


def optimizer_step(opt, params, args, step: int) -> None:
    """Clip at 1, set this step's learning rate (100-step warm-up, cosine over ``schedule_steps``), step."""
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for group in opt.param_groups:
        group["lr"] = args.lr * min(1.0, (step + 1) / 100) * _cosine(step, args.schedule_steps)
    opt.step()


def _cosine(step: int, total: int) -> float:
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
