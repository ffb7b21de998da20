"""The VAE half of an Instruct conditioning image: pixels, posterior, sampled latent.

Official path (``HunyuanImage3ImageProcessor.get_image_with_size`` with
``return_type`` "vae_vit", then the pipeline's ``_encode_cond_image``):

1. The SOURCE size (W, H) is snapped to the nearest-ratio row of the
   Instruct table (``resolution.instruct_table(image_base_size)``).
2. ``resize_and_crop``: scale with PIL LANCZOS so the image covers the row,
   keeping its aspect, then crop the centre; ``ToTensor`` + ``Normalize(0.5,
   0.5)`` give pixels in [-1, 1]. The ratio index is that of the cropped size.
3. The VAE encoder gives the posterior (mean, clamped logvar).
4. The latent is a posterior SAMPLE, never the mean: for each conditioning
   image in order, ``eps = randn((1, C, 1, h, w), generator=g)`` from the
   request's per-sample generator, drawn before any other draw of the request
   (the gen-image noise comes after, so it depends on the cond images), and
   ``latent = (mean + exp(logvar / 2) * eps) * scaling_factor``.

The ViT half (SigLIP2 on the original pixels) and the sequence layout are
elsewhere. ``posterior(..., tile=)`` encodes large inputs tile by tile
(``omni.vae_tiling.tiled_encode``); the official code never tiles, so tiled
moments are close to, not equal to, the untiled ones.

Shape suffixes: C latent channels, h/w latent rows/cols, H/W pixel rows/cols.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from PIL import Image

from omni.vae_tiling import tiled_encode

from .resolution import Table, nearest
from .vae import AutoencoderKLConv3D

Posterior = tuple[torch.Tensor, torch.Tensor]  # (mean_1Chw, logvar_1Chw), fp32


def resize_and_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    """Official ``resize_and_crop`` (crop_type "center"): cover ``width x height`` with LANCZOS, crop the middle.

    Python's ``round`` (half to even) is the official rounding, for the scaled
    side and for the crop offsets alike.
    """
    w, h = image.size
    if h / w < height / width:
        size = (int(round(height / h * w)), height)
    else:
        size = (width, int(round(width / w * h)))
    top, left = int(round((size[1] - height) / 2.0)), int(round((size[0] - width) / 2.0))
    image = image.resize(size, resample=Image.Resampling.LANCZOS)
    return image.crop((left, top, left + width, top + height))


def _as_pil(image_HW3_uint8) -> Image.Image:
    array = image_HW3_uint8.cpu().numpy() if isinstance(image_HW3_uint8, torch.Tensor) else np.asarray(image_HW3_uint8)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"conditioning image: expected uint8 (H, W, 3), got {array.dtype} {array.shape}")
    return Image.fromarray(np.ascontiguousarray(array))


def vae_input(image_HW3_uint8, table: Table) -> tuple[torch.Tensor, tuple[int, int], int]:
    """``(pixels_13HW in [-1, 1] fp32, (H, W), ratio_index)`` of one conditioning image.

    ``image_HW3_uint8`` is a numpy array or tensor; ``table`` the Instruct
    ratio table of the checkpoint's ``image_base_size``.
    """
    image = _as_pil(image_HW3_uint8)
    H, W = table[nearest(table, image.height, image.width)]
    crop = torch.from_numpy(np.array(resize_and_crop(image, W, H))).permute(2, 0, 1).contiguous()
    pixels_3HW = (crop.float().div(255) - 0.5) / 0.5  # torchvision ToTensor + Normalize([0.5], [0.5])
    return pixels_3HW.unsqueeze(0), (H, W), nearest(table, H, W)


@torch.no_grad()
def posterior(vae: AutoencoderKLConv3D, pixels_13HW: torch.Tensor, *, tile: int | None = None,
              overlap: int = 4) -> Posterior:
    """Posterior ``(mean, logvar)`` ``[1, C, h, w]`` in fp32; ``tile`` (latents) encodes large inputs in tiles.

    Without ``tile``, or when the image fits one tile, this is the official
    untiled encode. Tiles blend the encoder's moments, as the official
    (unused) tiled encode does before it builds the distribution.
    """
    x = pixels_13HW.float()
    factor = vae.cfg.ffactor_spatial
    if tile is None or max(x.shape[-2:]) <= tile * factor:
        mean, logvar = vae.encode(x)
        return mean.float(), logvar.float()
    moments = tiled_encode(lambda t: torch.cat(vae.encode(t), dim=1), x, tile=tile, overlap=overlap, factor=factor)
    mean, logvar = moments.chunk(2, dim=1)
    return mean, logvar


def draw_eps(posteriors: Sequence[Posterior], generator: torch.Generator) -> list[torch.Tensor]:
    """One ``randn((1, C, 1, h, w))`` per image, in order, on the generator's device (fp32)."""
    eps = []
    for mean, _ in posteriors:
        _, C, h, w = mean.shape
        eps.append(torch.randn((1, C, 1, h, w), generator=generator, device=generator.device).squeeze(2))
    return eps


def sample_latents(posteriors: Sequence[Posterior], generator: torch.Generator,
                   scaling_factor: float) -> list[torch.Tensor]:
    """Conditioning latents ``[1, C, h, w]``: ``(mean + std * eps) * scaling_factor`` with eps drawn in order.

    Call this before drawing the gen-image noise from the same generator.
    """
    out = []
    for (mean, logvar), eps in zip(posteriors, draw_eps(posteriors, generator)):
        std = torch.exp(0.5 * logvar)
        out.append((mean + std * eps.to(mean.device)) * scaling_factor)
    return out
