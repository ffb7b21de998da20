"""HunyuanImage-3.0-Instruct behind the step engine: the instruct template and reference images.

Differences from the base model (``pipeline.HunyuanImage3T2I``), all from the
official Instruct-era code (``edit_sequence`` has the sequence layout):

* rows are ``build_edit_pair`` rows: the instruct template, the Instruct
  size rule over the ``image_base_size`` table, and one joint block per
  reference image in the user turn (none for text-to-image);
* the prefix holds the reference images: at prefill each joint block is a
  ``none`` (fully visible) segment between causal text segments, and its
  slots carry encoded pixels instead of token embeddings: the VAE tokens are
  ``patch_embed(latent, time_embed(0))``, the block's ``<timestep>`` is
  ``timestep_emb(0)``, the ViT slots are the aligner features (padded
  patches included);
* the request's generator draws one posterior sample per reference image
  (in order) before the image noise, so the noise of a seed depends on the
  references, as in the official pipeline. The draws are repeated from the
  seed where they are needed (noise at admission, samples at prefill)
  instead of being carried around: the generator is a pure function of it.

The references are encoded once per request (both CFG rows keep them); the
denoising steps never see them again, only their K/V in the pool.

Shape suffixes: L row tokens, D hidden, C latent channels, h/w latent grid,
P ViT slots per image, M backbone width.
"""
from __future__ import annotations

import dataclasses

import torch

from omni.request import ImageRequest
from omni.text_steps import CotPlan

from .cond_image import posterior, vae_input
from .edit_sequence import CondImage, EditSequence, TextRow, build_edit_pair, build_text_row
from .pipeline import HunyuanImage3T2I
from .resolution import instruct_table, nearest, token_grid
from .vision_preprocess import target_size


class HunyuanImage3Instruct(HunyuanImage3T2I):
    """The Instruct checkpoint: ``vision`` is its ``HunyuanVisionEncoder``; ``vae`` is built with its encoder.

    ``vae_encode_tile``: ``(tile, overlap)`` latents for a tiled encode of
    large reference images, None encodes whole.
    """

    DISTIL = False  # the CFG-distilled block (HunyuanImage3InstructDistil)

    def __init__(self, *, vision, vae_encode_tile: tuple[int, int] | None = None, **kw):
        super().__init__(**kw)
        self.vision, self.vae_encode_tile = vision, vae_encode_tile
        self.base_size = self.cfg.image_base_size
        self.table = instruct_table(self.base_size)

    # ---------------------------------------------------------------- rows
    def cond_layout(self, image_HW3) -> CondImage:
        """Where a reference image goes in the sequence, from its size alone (no pixel work)."""
        H, W = image_HW3.shape[:2]
        vae_hw = self.table[nearest(self.table, H, W)]
        p, P = self.vision.cfg.patch_size, self.vision.cfg.max_num_patches
        th, tw = target_size(H, W, p, P)
        return CondImage.from_sizes(vae_hw, nearest(self.table, *vae_hw), (th // p, tw // p), P,
                                    downsample=self.downsample)

    def build_rows(self, req: ImageRequest) -> list[EditSequence]:
        if req.template != "instruct":
            if req.images:
                raise ValueError(f"template {req.template!r} has no place for reference images; use 'instruct'")
            return super().build_rows(req)
        conds = [self.cond_layout(im) for im in req.images]
        kw = dict(height=req.height, width=req.width, downsample=self.downsample, base_size=self.base_size,
                  system_prompt=req.system_prompt, cot_text=req.cot_text, drop_think=req.drop_think,
                  distil=self.DISTIL)
        if not req.use_cfg or self.DISTIL:  # Distil: one row, the guidance scale is a token
            return list(build_edit_pair(self.tok, req.prompt, conds, cfg=False, **kw))
        if req.negative_prompt is None:
            return list(build_edit_pair(self.tok, req.prompt, conds, cfg=True, **kw))
        return [build_edit_pair(self.tok, p, conds, cfg=False, **kw)[0] for p in (req.prompt, req.negative_prompt)]

    def text_row(self, req) -> TextRow:
        """A ``TextRequest``'s prompt (T2T, or I2T with its reference images in the user turn)."""
        return build_text_row(self.tok, req.prompt, [self.cond_layout(im) for im in req.images],
                              downsample=self.downsample, system_prompt=req.system_prompt, base_size=self.base_size)

    def stop_ids(self, req) -> frozenset[int]:
        """The conversation template's stop token (``<|endoftext|>``, the official ``stop_token_ids``)."""
        return frozenset({self.tok.eos})

    def text_logits(self, h_TD: torch.Tensor) -> torch.Tensor:
        return self.transformer.text_logits(h_TD)

    def detokenize(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    # ---------------------------------------------------------------- think / recaption before the image
    COT_TASKS = ("recaption", "think", "think_recaption")

    def cot_plan(self, req: ImageRequest) -> CotPlan:
        """The official CoT pass of ``bot_task``: its opener, stop tokens and forced stage transitions.

        think: ``<think>`` ... stop at ``</think>`` / ``</recaption>``; recaption:
        ``<recaption>`` ... stop at ``</recaption>``; think_recaption: ``</think>``
        forces ``<recaption>``. With ``auto_size`` the last closing marker forces
        ``<answer><boi><img_size_B>`` and the ratio token is then chosen
        greedily among the table's ratio tokens only.
        """
        if req.bot_task not in self.COT_TASKS:
            raise ValueError(f"bot_task {req.bot_task!r}: expected image or one of {', '.join(self.COT_TASKS)}")
        tok = self.tok
        thinks = req.bot_task != "recaption"
        row = build_text_row(tok, req.prompt, [self.cond_layout(im) for im in req.images], downsample=self.downsample,
                             system_prompt=req.system_prompt, base_size=self.base_size,
                             opener="<think>" if thinks else "<recaption>")
        stop = {tok.end_of_think, tok.end_of_recaption} if thinks else {tok.end_of_recaption}
        forced = {tok.end_of_think: (tok.recaption,)} if req.bot_task == "think_recaption" else {}
        if not req.auto_size:
            return CotPlan(row, frozenset(stop), forced, max_tokens=req.cot_max_tokens)
        last = tok.end_of_think if req.bot_task == "think" else tok.end_of_recaption
        forced[last] = (tok.answer, tok.boi, tok.img_size(self.base_size))
        ratios = tuple(tok.img_ratio(k) for k in range(len(self.table)))
        return CotPlan(row, frozenset(stop), forced, choose_after=tok.img_size(self.base_size), choose_from=ratios,
                       max_tokens=req.cot_max_tokens)

    def image_row_bound(self, req: ImageRequest, plan: CotPlan) -> int:
        """Tokens one image-pass row can take at most: the prompt, a CoT of ``max_tokens`` (plus its
        markers, re-tokenised), the image block of the largest size the pass may pick."""
        rows = self.build_rows(dataclasses.replace(req, bot_task="image", cot_text=None))
        sizes = self.table if req.auto_size else [(req.height, req.width)]
        block = 1 + max(h * w for h, w in (token_grid(*hw, self.downsample) for hw in sizes))
        return rows[0].prefix_len + plan.max_tokens + 16 + block

    def image_pass(self, req: ImageRequest, tokens) -> ImageRequest:
        """The image request after its CoT pass: the generated text as ``cot_text``, the chosen size."""
        tok, tokens = self.tok, list(tokens)
        ratios = [tok.img_ratio(k) for k in range(len(self.table))]
        chosen = len(tokens) >= 2 and tokens[-2] == tok.img_size(self.base_size) and tokens[-1] in ratios
        if req.auto_size and chosen:  # the plan's greedy choice after the forced <img_size_B>
            k = ratios.index(tokens[-1])
            req = dataclasses.replace(req, height=self.table[k][0], width=self.table[k][1])
        if tok.answer in tokens:  # the forced <answer><boi><img_size_B> and the ratio are the image block's
            tokens = tokens[: tokens.index(tok.answer)]
        opener = "<recaption>" if req.bot_task == "recaption" else "<think>"
        return dataclasses.replace(req, bot_task="image", auto_size=False,
                                   cot_text=opener + self.detokenize(tokens))

    def prefix_segments(self, row) -> list[tuple[int, int, str]]:
        """Causal text, then each joint block fully visible, ...; the last segment ends the prefix."""
        segments, start = [], 0
        for a, b in (c.joint for c in getattr(row, "conds", ())):
            segments += [(start, a, "causal"), (a, b, "none")]
            start = b
        return segments + [(start, row.prefix_len, "causal")]

    # ---------------------------------------------------------------- prefix
    def prefix_input(self, req: ImageRequest, seed: int, rows, cached: int = 0) -> list[torch.Tensor]:
        """Token embeddings with the references' VAE tokens, ``<timestep>`` and ViT features placed.

        The references are not encoded when every slot they fill lies before ``cached`` (an image pass
        after its CoT pass: their K/V are in the pool already).
        """
        xs = super().prefix_input(req, seed, rows)
        if not req.images or all(c.vit[1] <= cached for r in rows for c in r.conds):
            return xs
        vae_LD, vit_PM = self.encode_references(req.images, seed)
        ts_1D = self.transformer.timestep_token(self._t(0.0, 1)).to(self.dtype)
        for row, x_LD in zip(rows, xs):
            for c, vae_tokens, vit_tokens in zip(row.conds, vae_LD, vit_PM):
                x_LD[c.timestep_index] = ts_1D[0]
                x_LD[c.vae[0]:c.vae[1]] = vae_tokens
                x_LD[c.vit[0]:c.vit[1]] = vit_tokens
        return xs

    @torch.inference_mode()
    def encode_references(self, images, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(VAE tokens ``[h*w, D]`` per image, ViT aligner features ``[n, P, M]``) in the model dtype."""
        latents = self.reference_latents(images, torch.Generator().manual_seed(seed))
        t0_1 = self._t(0.0, 1)
        vae_LD = [self.transformer.image_tokens(z.to(self.dtype), t0_1)[0] for z in latents]
        return vae_LD, self.vision.encode(images).to(self.dtype)

    def reference_latents(self, images, generator: torch.Generator) -> list[torch.Tensor]:
        """Posterior samples ``[1, C, h, w]`` fp32 of each image, eps drawn in order from ``generator``."""
        out = []
        for image in images:
            pixels_13HW = vae_input(image, self.table)[0].to(self.device)
            mean, logvar = self._posterior(pixels_13HW)
            eps = self._eps(generator, mean.shape).to(self.device)
            out.append((mean + torch.exp(0.5 * logvar) * eps) * self.vae.cfg.scaling_factor)
        return out

    def _posterior(self, pixels_13HW: torch.Tensor):
        """fp32 moments; the encoder runs under autocast to ``vae_dtype`` as the decoder does."""
        tile, overlap = self.vae_encode_tile or (None, 4)
        low = self.vae_dtype != torch.float32
        with torch.autocast(device_type=self.device.type, dtype=self.vae_dtype, enabled=low):
            return posterior(self.vae, pixels_13HW, tile=tile, overlap=overlap)

    @staticmethod
    def _eps(generator: torch.Generator, shape) -> torch.Tensor:
        """The official draw: ``randn((1, C, 1, h, w))`` on the (CPU) generator, fp32."""
        _, C, h, w = shape
        return torch.randn((1, C, 1, h, w), generator=generator).squeeze(2)

    # ---------------------------------------------------------------- sampler
    def noise(self, seed: int, row) -> torch.Tensor:
        """The image noise after one posterior draw per reference image (shapes from the row's slots)."""
        g = torch.Generator().manual_seed(seed)
        for c in getattr(row, "conds", ()):
            self._eps(g, (1, self.latent_channels, *c.vae_hw))
        shape = (1, self.latent_channels, row.token_h, row.token_w)
        return torch.randn(shape, generator=g, dtype=torch.bfloat16).float().to(self.device)


class HunyuanImage3InstructDistil(HunyuanImage3Instruct):
    """HunyuanImage-3.0-Instruct-Distil: CFG-distilled MeanFlow, one row per request, 8 steps by default.

    The step block is ``<timestep> <guidance> <timestep_r>`` + the image run:
    ``timestep_emb(t)``, ``guidance_emb(bf16(1000 * scale))`` and
    ``timestep_r_emb(r)`` with ``r`` the next timestep (0 at the last step).
    Each special token is causal (one query over the keys before it and
    itself); ``final_layer`` reads the image rows only. The guided prediction
    is the model's output as is (no unconditional row to combine with).
    """

    DISTIL, SPECIALS = True, 3

    def build_rows(self, req: ImageRequest) -> list[EditSequence]:
        if req.negative_prompt is not None:
            raise ValueError("negative_prompt: a CFG-distilled checkpoint has no unconditional row to put it in")
        if req.template != "instruct":
            raise ValueError(f"template {req.template!r}: the Distil checkpoint uses the instruct template")
        return super().build_rows(req)

    def special_tokens(self, t_1: torch.Tensor, sigma_next: float, guidance: float) -> list[torch.Tensor]:
        """``<timestep> <guidance> <timestep_r>``: t, the guidance scale, and the next timestep r."""
        tr, g_1 = self.transformer, torch.full((1,), guidance, dtype=torch.float32, device=self.device)
        return [tr.timestep_token(t_1), tr.guidance_token(g_1), tr.timestep_r_token(self._t(sigma_next, 1))]
