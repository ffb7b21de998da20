"""HunyuanImage-3.0 text-to-image as a ``omni.step_model.StepModel`` (DESIGN.md, "The model").

A row is one CFG row of the official sequence (``build_t2i_pair``): text and
special tokens up to ``<timestep>`` are the prefix; the step block is
``<timestep>`` + the image tokens. The block is two varlen runs with no
mask: the timestep query over ``[prefix; timestep]`` and the image queries
over ``[prefix; timestep; image]``, exactly the official generalized-causal
mask without materialising it. The sampler is flow-matching Euler with
classifier-free guidance over the (conditional, unconditional) rows; the
noise is drawn in bf16 on a CPU generator, as the official code does.

The generic machinery around it (pages, packing, step cache, graphs, CFG
exchange, tiled decode) is ``omni.step_engine.StepEngine``.

Shape suffixes: T packed tokens, D hidden, H head dim (rope tables), B rows,
C latent channels, h/w token grid, 3HW pixels.
"""
from __future__ import annotations

import torch

from omni.device import upload
from omni.request import ImageRequest

from .resolution import snap
from .rope import rope_cos_sin
from .sampler import cfg_combine, euler_step, flow_match_sigmas
from .sequence import T2ISequence, build_t2i_pair


class HunyuanImage3T2I:
    """The transformer, VAE and tokenizer of one worker behind the step engine's model interface.

    The step block is ``SPECIALS`` special tokens (``special_tokens``: here
    ``<timestep>``) then the image run; each special token is its own causal
    run, the image run sees the whole block.
    """

    SPECIALS = 1
    def __init__(self, *, transformer, vae, tokenizer, config, device, vae_dtype: torch.dtype = torch.float32):
        self.transformer, self.vae, self.tok, self.cfg = transformer, vae, tokenizer, config
        self.device, self.vae_dtype = torch.device(device), vae_dtype
        self.downsample = config.vae_downsample_factor[0] * config.patch_size
        self.latent_channels = vae.cfg.latent_channels

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.model.wte.weight.dtype

    @property
    def pixels_per_latent(self) -> int:
        return self.vae.cfg.ffactor_spatial

    # ---------------------------------------------------------------- rows
    def build_rows(self, req: ImageRequest) -> list[T2ISequence]:
        if req.images:  # the API and the CLI refuse these first (ModelHelpers.max_images is 0)
            raise ValueError("this checkpoint does not take reference images (editing needs an Instruct flavour)")
        base = self.cfg.image_base_size  # 1024 for the released model, 256 for the embedded tiny one
        _, h_px, w_px = snap(req.height, req.width, base=base)
        kw = dict(template=req.template, height=h_px, width=w_px, downsample=self.downsample, base_size=base,
                  system_prompt=req.system_prompt, cot_text=req.cot_text, drop_think=req.drop_think)
        if not req.use_cfg:
            return list(build_t2i_pair(self.tok, req.prompt, cfg=False, **kw))
        if req.negative_prompt is None:
            return list(build_t2i_pair(self.tok, req.prompt, cfg=True, **kw))
        return [build_t2i_pair(self.tok, p, cfg=False, **kw)[0] for p in (req.prompt, req.negative_prompt)]

    def block_len(self, row: T2ISequence) -> int:  # special tokens + image tokens
        return self.SPECIALS + row.token_h * row.token_w

    def block_spans(self, row: T2ISequence) -> list[tuple[int, int]]:
        p, k = row.prefix_len, self.SPECIALS
        return [(p + i, p + i + 1) for i in range(k)] + [(p + k, p + self.block_len(row))]

    def rope(self, pos_yx) -> tuple[torch.Tensor, torch.Tensor]:
        pos_T2 = upload(pos_yx, self.device, torch.long)  # queued: the host does not wait for the device here
        cos, sin = rope_cos_sin(pos_T2, self.cfg.head_dim, self.cfg.rope_theta)
        return cos.to(self.dtype), sin.to(self.dtype)

    # ---------------------------------------------------------------- forwards
    def embed(self, ids) -> torch.Tensor:
        """Token embeddings of ``ids``: a list, or an int tensor on the device (a decode step's, gathered there)."""
        ids_T = ids if isinstance(ids, torch.Tensor) else upload(ids, self.device, torch.long)
        return self.transformer.embed_tokens(ids_T)

    def prefix_input(self, req: ImageRequest, seed: int, rows: list[T2ISequence],
                     cached: int = 0) -> list[torch.Tensor]:
        """Text only: each prefix is its token embeddings."""
        return [self.embed(r.ids[: r.prefix_len]) for r in rows]

    def prefix_segments(self, row: T2ISequence) -> list[tuple[int, int, str]]:
        return [(0, row.prefix_len, "causal")]

    def block_input(self, latents_1Chw: torch.Tensor, sigma: float, rows: list[T2ISequence], *,
                    sigma_next: float = 0.0, guidance: float = 1.0) -> torch.Tensor:
        """``[special tokens; image tokens]`` of the latents at ``sigma``, once per row (the rows share them)."""
        t_1 = self._t(sigma, 1)
        img_1LD = self.transformer.image_tokens(latents_1Chw.to(self.dtype), t_1)
        specials = [x.to(self.dtype) for x in self.special_tokens(t_1, sigma_next, guidance)]
        return torch.cat([x for _ in rows for x in (*specials, img_1LD[0])])

    def special_tokens(self, t_1: torch.Tensor, sigma_next: float, guidance: float) -> list[torch.Tensor]:
        """``[1, D]`` embeddings of the block's special tokens: ``<timestep>`` (t on the 0..1000 scale)."""
        return [self.transformer.timestep_token(t_1)]

    def backbone(self, x_TD, cos_TH, sin_TH, ctx) -> torch.Tensor:
        return self.transformer.backbone(x_TD, cos_TH, sin_TH, ctx)

    def velocity(self, h_TD: torch.Tensor, rows: list[T2ISequence], sigma: float) -> torch.Tensor:
        """The image head on each row's image tokens (its block without the special tokens), fp32."""
        h_BnD = h_TD.view(len(rows), -1, h_TD.shape[-1])[:, self.SPECIALS:]  # rows share one block length
        return self.transformer.velocity(h_BnD, self._t(sigma, len(rows)), rows[0].token_h, rows[0].token_w).float()

    def _t(self, sigma: float, n: int) -> torch.Tensor:
        """The model's timestep: 1000 * sigma, fp32 ``[n]`` on the device."""
        return torch.full((n,), sigma * 1000.0, dtype=torch.float32, device=self.device)

    # ---------------------------------------------------------------- sampler
    def noise(self, seed: int, row: T2ISequence) -> torch.Tensor:
        """Noise drawn in bf16 on a CPU generator (as the official code), identical for both rows.

        torch's bf16 normal kernel differs between releases and CPU instruction
        sets (2.11 on AVX512 and 2.13 on AVX2 give different values for one
        seed), exactly as the official ``randn_tensor(dtype=bf16)`` does: a seed
        reproduces the official image on the same torch and CPU kind.
        """
        g = torch.Generator().manual_seed(seed)
        shape = (1, self.latent_channels, row.token_h, row.token_w)
        return torch.randn(shape, generator=g, dtype=torch.bfloat16).float().to(self.device)

    def sigmas(self, req: ImageRequest) -> torch.Tensor:
        return flow_match_sigmas(req.steps, req.shift)

    def sample_step(self, latents_1Chw, v_BChw, sigma, sigma_next, guidance: float) -> torch.Tensor:
        """Guidance (two rows) and one Euler step."""
        v = cfg_combine(v_BChw[:1], v_BChw[1:], guidance) if v_BChw.shape[0] == 2 else v_BChw
        return euler_step(latents_1Chw, v, sigma, sigma_next)

    # ---------------------------------------------------------------- output
    def decode_latents(self, z_BChw: torch.Tensor) -> torch.Tensor:
        return self.vae.decode_image(z_BChw, dtype=self.vae_dtype)
