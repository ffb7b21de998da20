"""SigLIP2 "naflex" preprocessing of a conditioning image for the HunyuanImage-3.0 ViT.

The official ``Siglip2ImageProcessorFast`` keeps the aspect ratio and lets the
patch count vary up to ``max_num_patches``:

1. target size: bisection on a scale ``s``; each side becomes
   ``max(p, ceil(n * s / p) * p)`` and the largest ``s`` whose grid
   ``(th / p) * (tw / p)`` fits ``max_num_patches`` wins;
2. resize the ORIGINAL uint8 image (not the VAE's cropped input) with torch
   bilinear interpolation, antialias on, ``align_corners=False``; on uint8 the
   interpolation itself rounds back to uint8;
3. ``x = (x / 255 - mean) / std`` (0.5 / 0.5 in the released config), computed
   as the fast processor fuses it: ``(x - 255 * mean) / (255 * std)`` (that is
   what the golden pixels equal bit for bit; the unfused form is 1 ulp off);
4. patchify row-major over the ``(th / p, tw / p)`` grid, each patch flattened
   in ``(p, p, C)`` order, then pad with zero rows to ``max_num_patches``;
   the mask is 1 on real patches.

Shape suffixes: H/W source pixel rows/cols, C channels, P = max_num_patches,
F = p * p * C values per patch, B images.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SCALE_MIN, SCALE_MAX, SCALE_EPS = 1e-6, 100.0, 1e-5  # the official search interval and stop width


@dataclass(frozen=True)
class VisionInputs:
    """A batch of preprocessed images: pixels ``[B, P, F]``, grids ``(h, w)`` in patches, mask ``[B, P]`` bool."""

    pixel_values_BPF: torch.Tensor
    spatial_hw: tuple[tuple[int, int], ...]
    mask_BP: torch.Tensor

    def to(self, device) -> "VisionInputs":
        return VisionInputs(self.pixel_values_BPF.to(device), self.spatial_hw, self.mask_BP.to(device))


def _side(scale: float, n: int, patch: int) -> int:
    return max(patch, math.ceil(n * scale / patch) * patch)


def target_size(height: int, width: int, patch: int, max_num_patches: int) -> tuple[int, int]:
    """(th, tw) in pixels, multiples of ``patch``, with at most ``max_num_patches`` patches (official bisection)."""
    lo, hi = SCALE_MIN, SCALE_MAX
    while hi - lo >= SCALE_EPS:
        mid = (lo + hi) / 2
        if (_side(mid, height, patch) / patch) * (_side(mid, width, patch) / patch) <= max_num_patches:
            lo = mid
        else:
            hi = mid
    return _side(lo, height, patch), _side(lo, width, patch)


def resize_uint8(image_CHW: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear + antialias on the uint8 tensor itself (torch rounds the result back to uint8)."""
    if tuple(image_CHW.shape[1:]) == tuple(size):
        return image_CHW
    return F.interpolate(image_CHW[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]


def patchify(x_CHW: torch.Tensor, patch: int) -> torch.Tensor:
    """``[C, h*p, w*p] -> [h*w, p*p*C]``: patches row-major, values in (p, p, C) order."""
    C, H, W = x_CHW.shape
    x_hpwpC = x_CHW.reshape(C, H // patch, patch, W // patch, patch).permute(1, 3, 2, 4, 0)
    return x_hpwpC.reshape((H // patch) * (W // patch), patch * patch * C)


def preprocess(image_HW3: torch.Tensor, cfg) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor]:
    """One uint8 ``[H, W, C]`` image -> (pixel_values ``[P, F]`` fp32, grid ``(h, w)``, mask ``[P]`` bool).

    ``cfg`` is a ``VisionConfig`` (``patch_size``, ``max_num_patches``, ``image_mean``, ``image_std``).
    """
    image_CHW = torch.as_tensor(image_HW3).permute(2, 0, 1).contiguous()
    if image_CHW.dtype != torch.uint8:
        raise TypeError(f"preprocess expects a uint8 [H, W, C] image, got {image_CHW.dtype}")
    p, P = cfg.patch_size, cfg.max_num_patches
    th, tw = target_size(image_CHW.shape[1], image_CHW.shape[2], p, P)
    x_CHW = resize_uint8(image_CHW, (th, tw)).float()
    mean = torch.tensor([255 * m for m in cfg.image_mean], dtype=torch.float32)[:, None, None]
    std = torch.tensor([255 * s for s in cfg.image_std], dtype=torch.float32)[:, None, None]
    patches_nF = patchify((x_CHW - mean) / std, p)
    n = patches_nF.shape[0]
    pixels_PF = torch.cat([patches_nF, patches_nF.new_zeros(P - n, patches_nF.shape[1])])
    mask_P = torch.arange(P) < n
    return pixels_PF, (th // p, tw // p), mask_P


def preprocess_batch(images, cfg) -> VisionInputs:
    """Several images (each uint8 ``[H, W, C]``, any sizes) -> one padded ``VisionInputs`` batch."""
    pixels, grids, masks = zip(*(preprocess(im, cfg) for im in images))
    return VisionInputs(torch.stack(pixels), tuple(grids), torch.stack(masks))
