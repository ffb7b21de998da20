"""Train the tiny Instruct model: edit pairs (and instruct-template text-to-image) from the trained base.

Starts from the shipped base checkpoint (``assets/tiny_trained``): the same
widths, its transformer weights (the vocabulary grows by the Instruct
specials and the edit words, appended, so every old id keeps its row) and
its VAE, frozen; a tiny SigLIP2 ViT and aligner are added and trained. The
image base is 256 (the smallest the Instruct ratio table allows), so a row
is ``[bos] User: <cond block: 4 + 256 VAE + sep + 64 ViT + eoi> instruction
Assistant: <answer> <gen block: 4 + 256>``, as ``edit_sequence.build_edit_pair``
builds it for serving.

The forward is the serving path's, spelled with gradients: the reference's
VAE tokens are ``image_tokens(latent, t=0)``, its ``<timestep>`` is
``timestep_token(0)``, its ViT slots the aligner features of the same uint8
image the server would see; the generated block as in ``train.py``. The
reference latent is the pinned latent (``train.pinned_latent``, which the
shipped encoder was trained to regress) plus the posterior noise the
sampler draws. CFG dropout: ``DROP_P`` of the rows are the Instruct
unconditional row (the instruction's tokens become ``<cfg>``, the reference
stays). ``T2I_P`` of the rows carry no reference: a caption of ``data`` drawn
at 256 with the instruct template, so the checkpoint also draws from text.

Runs on the CPU or a CUDA device (``--device``); the data and noise of step s
are a function of (seed, s) on either.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omni.attention_context import DenseContext, dense_meta
from omni.build_options import BuildOptions
from omni.platform_manager import select
from omni.weights import LoadTarget, load_checkpoint

from .. import tiny
from ..assets.make_tiny_tokenizer import build as build_tokenizer
from ..config import HunyuanImage3Config
from ..edit_sequence import CondImage, build_edit_pair
from ..resolution import instruct_table, nearest
from ..rope import rope_cos_sin
from ..tokenizer import Tokenizer
from ..transformer import HunyuanImage3Transformer
from ..vae import AutoencoderKLConv3D, VAEConfig
from ..vision import HunyuanVisionEncoder, VisionConfig
from ..vision_preprocess import target_size
from . import data, edits
from .train import DROP_P, LATENT_STD, noised, optimizer_step, pinned_latent

T2I_P = 0.25  # rows drawn from a caption with no reference image
INSTRUCT_TOKENS = ("<img_size_256>", "<img_ratio_33>", "<img_ratio_34>", "<img_ratio_35>", "<img_ratio_36>",
                   "<timestep_r>", *edits.WORDS)
VISION = {"cond_image_type": "vae_vit", "cond_token_attn_type": "joint_full",
          "vit_type": "siglip2-so400m-patch16-naflex", "model_version": "HunyuanImage-3.0-Instruct",
          "vit": {"hidden_act": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 128,
                  "layer_norm_eps": 1e-6, "num_attention_heads": 2, "num_channels": 3, "num_hidden_layers": 1,
                  "num_patches": 64, "patch_size": 16},
          "vit_processor": {"max_num_patches": 64, "patch_size": 16}}


def base_checkpoint() -> Path:
    return tiny.trained_checkpoint_dir()


def instruct_vocab(base: Path) -> dict[str, int]:
    """The base checkpoint's vocabulary with ``INSTRUCT_TOKENS`` appended (old ids unchanged)."""
    vocab = dict(json.loads((base / "tokenizer.json").read_text())["model"]["vocab"])
    for token in INSTRUCT_TOKENS:
        vocab.setdefault(token, len(vocab))
    return vocab


def instruct_config(base: Path, vocab_size: int) -> dict:
    """The base checkpoint's config, widened vocabulary, image base 256, plus the vision parts."""
    config = json.loads((base / "config.json").read_text())
    hidden = config["hidden_size"]
    aligner = {"projector_type": "mlp_gelu", "input_dim": VISION["vit"]["hidden_size"], "n_embed": hidden, "depth": 2}
    return {**config, **VISION, "vit_aligner": aligner, "vocab_size": vocab_size, "image_base_size": edits.SIZE}


def _grown(init: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``init`` with ``trained`` copied over it; a tensor with more rows than the trained one (the grown
    vocabulary) keeps its init past them."""
    out = {}
    for name, t in init.items():
        out[name] = t.clone()
        out[name][: trained[name].shape[0]] = trained[name]
    return out


class InstructTrainer:
    """The tiny Instruct transformer and ViT (trained), the base VAE (frozen), their optimizer and step."""

    PARTS = ("edit",)  # what checkpoint.save_state / load_state keep of this run

    def __init__(self, args):
        self.args, self.device, base = args, torch.device(args.device), base_checkpoint()
        self.vocab = instruct_vocab(base)
        self.config = instruct_config(base, len(self.vocab))
        self.tok = Tokenizer(build_tokenizer(self.vocab))
        cfg, platform = HunyuanImage3Config.from_json_dict(self.config), select("cpu")
        opts = BuildOptions(dtype=torch.float32)
        self.model = HunyuanImage3Transformer(cfg, platform, opts)
        self.vision = HunyuanVisionEncoder(VisionConfig.from_model_config(cfg), platform, opts)
        self._init(base)
        self.trainable = torch.nn.ModuleDict({"model": self.model, "vision": self.vision}).to(self.device)
        self.trainable.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.trainable.parameters(), lr=args.lr, weight_decay=0.01)
        self.scale = float(self.config["vae"]["scaling_factor"])
        self.table = instruct_table(edits.SIZE)
        self.downsample = cfg.vae_downsample_factor[0] * cfg.patch_size  # pixels per latent token side
        self.step, self.log = 0, {"edit": []}

    def _init(self, base: Path) -> None:
        """Seeded random init everywhere, then the base checkpoint's transformer and VAE over it."""
        g = torch.Generator().manual_seed(self.args.seed)
        with torch.no_grad():
            for module in (self.model, self.vision):
                for name, p in module.named_parameters():
                    tiny._init_(name, p, g)
        trained = HunyuanImage3Transformer(HunyuanImage3Config.from_file(base / "config.json"), select("cpu"),
                                           BuildOptions(dtype=torch.float32))
        self.vae = AutoencoderKLConv3D(VAEConfig.from_dict(self.config["vae"]))
        load_checkpoint(base, [LoadTarget("", trained, trained.param_name_for), LoadTarget("vae.", self.vae)],
                        progress=False)  # the engine's loader: official names, per-expert tensors
        self.model.load_state_dict(_grown(self.model.state_dict(), trained.state_dict()))
        self.vae.requires_grad_(False)

    # ------------------------------------------------------------ rows
    def cond_image(self) -> CondImage:
        """The layout of a 256 x 256 reference, as ``HunyuanImage3Instruct.cond_layout`` computes it."""
        p, P = self.vision.cfg.patch_size, self.vision.cfg.max_num_patches
        th, tw = target_size(edits.SIZE, edits.SIZE, p, P)
        k = nearest(self.table, edits.SIZE, edits.SIZE)
        return CondImage.from_sizes(self.table[k], k, (th // p, tw // p), P, downsample=self.downsample)

    def rows(self, prompts: list[str], has_ref: list[bool], g: torch.Generator) -> list:
        drop = (torch.rand(len(prompts), generator=g) < DROP_P).tolist()
        cond = self.cond_image()
        return [build_edit_pair(self.tok, p, [cond] if r else [], height=edits.SIZE, width=edits.SIZE,
                                downsample=self.downsample, base_size=edits.SIZE)[int(d)]
                for p, r, d in zip(prompts, has_ref, drop)]

    def embed_row(self, row, img_LD, ts_D, ref) -> tuple[torch.Tensor, int]:
        """The row's input up to its image run (what follows is causal after it), and that length."""
        n = row.image_span[1]
        x_LD = self.model.embed_tokens(torch.tensor(row.ids[:n], device=self.device))
        x_LD = x_LD.index_copy(0, torch.tensor([row.timestep_index], device=self.device), ts_D[None])
        parts, start = [], 0
        for c in row.conds:  # reference slots: timestep 0, VAE tokens, ViT features
            vae_LD, vit_PD, ts0_D = ref
            parts += [x_LD[start:c.timestep_index], ts0_D[None], vae_LD, x_LD[c.vae[1]:c.vit[0]], vit_PD]
            start = c.vit[1]
        parts += [x_LD[start:row.image_span[0]], img_LD]
        return torch.cat(parts), n

    def velocity(self, rows, xt_BChw, sigma_B, refs) -> torch.Tensor:
        t_B = sigma_B * 1000.0
        img_BLD, ts_BD = self.model.image_tokens(xt_BChw, t_B), self.model.timestep_token(t_B)
        xs, masks, pos = [], [], []
        for i, row in enumerate(rows):
            x_LD, n = self.embed_row(row, img_BLD[i], ts_BD[i], refs[i])
            xs.append(x_LD)
            masks.append(row.attention_mask()[:n, :n])
            pos += row.pos_yx[:n]
        cos_TH, sin_TH = rope_cos_sin(torch.tensor(pos, device=self.device), self.model.cfg.head_dim,
                                      self.model.cfg.rope_theta)
        mask = torch.block_diag(*masks).to(self.device)
        h_TD = self.model.backbone(torch.cat(xs), cos_TH, sin_TH, DenseContext(dense_meta(mask)))
        ends = torch.tensor([r.image_span[1] for r in rows]).cumsum(0).tolist()
        L = xt_BChw.shape[2] * xt_BChw.shape[3]
        return self.model.velocity(torch.stack([h_TD[e - L:e] for e in ends]), t_B, *xt_BChw.shape[2:])

    # ------------------------------------------------------------ step
    def references(self, src_B3HW: np.ndarray, has_ref: list[bool], g: torch.Generator) -> list:
        """Per row: (VAE tokens [h*w, D], ViT features [P, D], timestep-0 token [D]) of its reference, or None."""
        idx = [i for i, r in enumerate(has_ref) if r]
        out = [None] * len(has_ref)
        if not idx:
            return out
        x = torch.from_numpy(src_B3HW[idx])
        z = pinned_latent(x)
        z = (z + LATENT_STD * torch.randn(z.shape, generator=g)) * self.scale
        t0 = torch.zeros(len(idx), device=self.device)
        vae_BLD = self.model.image_tokens(z.to(self.device), t0)
        images = [torch.from_numpy(edits.to_uint8(s)) for s in src_B3HW[idx]]
        vit_BPD = self.vision(self.vision.preprocess(images))[1]
        ts0_D = self.model.timestep_token(t0[:1])[0]
        for j, i in enumerate(idx):
            out[i] = (vae_BLD[j], vit_BPD[j], ts0_D)
        return out

    def batch(self, g: torch.Generator):
        """(sources, targets, prompts, has_ref) of this step: edit pairs, T2I_P of them replaced by captions."""
        a = self.args
        src, tgt, prompts = edits.edit_batch(a.seed, self.step, a.batch)
        t2i, captions = data.batch(a.seed + 5, self.step, a.batch, size=edits.SIZE)
        has_ref = (torch.rand(a.batch, generator=g) >= T2I_P).tolist()
        tgt = np.stack([t if r else c for t, c, r in zip(tgt, t2i, has_ref)])
        prompts = [p if r else c for p, c, r in zip(prompts, captions, has_ref)]
        return src, tgt, prompts, has_ref

    def train_step(self) -> float:
        a = self.args
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + 11 + self.step)
        src, tgt, prompts, has_ref = self.batch(g)
        xt, sigma, target = (t.to(self.device) for t in noised(pinned_latent(torch.from_numpy(tgt)) * self.scale, g))
        rows = self.rows(prompts, has_ref, g)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for s in range(0, len(rows), a.group):
            sl = slice(s, s + a.group)
            refs = self.references(src[sl], has_ref[sl], g)
            v = self.velocity(rows[sl], xt[sl], sigma[sl], refs)
            loss = F.mse_loss(v, target[sl]) * v.shape[0] / len(rows)
            loss.backward()
            total += loss.item()
        optimizer_step(self.opt, self.trainable.parameters(), a, self.step)
        self.step += 1
        return total
