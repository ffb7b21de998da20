"""Image similarity for quality gates: PSNR and SSIM in plain torch (no new dependency).

Both take images as ``[H, W, C]`` or ``[H, W]`` tensors (uint8 or float) on a
common ``data_range`` (255 for uint8 pixels). SSIM is Wang et al. 2004: an
11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, computed per channel
on the valid region and averaged, as ``skimage.metrics.structural_similarity``
with ``gaussian_weights=True``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB (inf for identical images)."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10.0 * math.log10(data_range ** 2 / mse)


def _window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-x ** 2 / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 255.0, win: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity over channels (1.0 for identical images)."""
    def chw(t):
        t = t.double()
        return (t[None] if t.dim() == 2 else t.permute(2, 0, 1))[:, None]  # [C, 1, H, W]

    x, y = chw(a), chw(b)
    if x.shape != y.shape:
        raise ValueError(f"ssim: shapes differ {tuple(a.shape)} vs {tuple(b.shape)}")
    if min(x.shape[-2:]) < win:
        raise ValueError(f"ssim: images smaller than the {win}x{win} window")
    w = _window(win, sigma)
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mx, my = F.conv2d(x, w), F.conv2d(y, w)
    sxx = F.conv2d(x * x, w) - mx * mx
    syy = F.conv2d(y * y, w) - my * my
    sxy = F.conv2d(x * y, w) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return float(s.mean())
