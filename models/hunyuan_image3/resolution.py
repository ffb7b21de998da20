"""Image sizes, aspect-ratio tokens and token grids for HunyuanImage-3.0.

The model never sees a pixel size. It sees ``<img_size_1024>`` (the table's
base size, constant) and ``<img_ratio_k>``, where k indexes a fixed table of
(height, width) rows sorted by H/W. A requested size therefore only picks the
aspect: it is snapped to the row whose H/W is nearest, and that row's pixels
are what gets generated (base-model behaviour, official ``ResolutionGroup``).

Sizes are (height, width) everywhere in this module; user-facing "WxH"
strings are parsed by ``omni.recipe.parse_size``.
"""
from __future__ import annotations

BASE_SIZE = 1024
STEP = 64


def _walk(base: int, step: int, dh: int) -> list[tuple[int, int]]:
    """Rows from base x base toward one extreme: height moves by ``dh*step``.

    Both sides are clamped to [base/2, 2*base]; the walk stops once both sit
    at their clamps, exactly like the official ``_calc_by_step`` loops.
    """
    lo, hi = base // 2, base * 2
    h_end, w_end = (hi, lo) if dh > 0 else (lo, hi)
    rows, h, w = [], base, base
    while (h, w) != (h_end, w_end):
        h = min(max(h + dh * step, lo), hi)
        w = min(max(w - dh * step, lo), hi)
        rows.append((h, w))
    return rows


def ratio_table(base: int = BASE_SIZE, step: int = STEP) -> tuple[tuple[int, int], ...]:
    """The official ratio rows (height, width) sorted by H/W; index = ratio token k."""
    rows = [(base, base)] + _walk(base, step, +1) + _walk(base, step, -1)
    return tuple(sorted(rows, key=lambda hw: hw[0] / hw[1]))


RESOLUTIONS: tuple[tuple[int, int], ...] = ratio_table()
"""33 rows, k = 0 (512x2048, widest) .. 16 (1024x1024) .. 32 (2048x512, tallest)."""

INSTRUCT_EXTRA: tuple[tuple[int, int], ...] = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))
"""Rows the Instruct checkpoints append unsorted after the 33 (k = 33..36)."""


def rows(extra: bool = False) -> tuple[tuple[int, int], ...]:
    """The addressable rows: 33 for the base model, 37 with the Instruct extras."""
    return RESOLUTIONS + INSTRUCT_EXTRA if extra else RESOLUTIONS


def snap(height: int, width: int, *, extra: bool = False) -> tuple[int, int, int]:
    """Snap a requested size to the nearest-ratio row: (k, h_px, w_px).

    Ties go to the lower k (``np.argmin`` semantics). ``extra=True`` also
    considers the Instruct rows k 33..36.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"bad image size {height}x{width} (HxW): sides must be positive")
    table = rows(extra)
    ratio = height / width
    k = min(range(len(table)), key=lambda i: abs(table[i][0] / table[i][1] - ratio))
    return (k, *table[k])


def token_grid(h_px: int, w_px: int, downsample: int) -> tuple[int, int]:
    """Latent token grid (th, tw) for an image: floor division by the VAE factor.

    ``downsample`` is vae_downsample_factor * patch_size (16 for the released
    model). Floor, not ceil, because the official ``build_image_info`` floors.
    """
    th, tw = h_px // downsample, w_px // downsample
    if th < 1 or tw < 1:
        raise ValueError(f"image {h_px}x{w_px} (HxW) is smaller than one token at downsample {downsample}")
    return th, tw
