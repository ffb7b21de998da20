"""Image sizes, aspect-ratio tokens and token grids for HunyuanImage-3.0.

The model never sees a pixel size. It sees ``<img_size_B>`` (B = the table's
base size, constant) and ``<img_ratio_k>``, where k indexes a fixed table of
(height, width) rows sorted by H/W. A requested size therefore only picks the
aspect: it is snapped to the row whose H/W is nearest, and that row's pixels
are what gets generated (official ``ResolutionGroup``).

Two tables exist. The base model uses the 33 sorted rows of base 1024
(``RESOLUTIONS``). The Instruct checkpoints build the sorted rows from the
config's ``image_base_size`` (step base/16, rows floored to a multiple of 16)
and append four ABSOLUTE rows, unsorted and not scaled with the base
(``instruct_table``); conditioning images and ``instruct_size`` snap to it.

Sizes are (height, width) everywhere in this module; user-facing "WxH"
strings are parsed by ``omni.recipe.parse_size``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

BASE_SIZE = 1024
STEP = 64
INSTRUCT_ALIGN = 16  # official ResolutionGroupConfig.align

Table = tuple[tuple[int, int], ...]


def _walk(base: int, step: int, dh: int, align: int) -> list[tuple[int, int]]:
    """Rows from base x base toward one extreme: height moves by ``dh*step``.

    Both sides are clamped to [base/2, 2*base]; the walk stops once both sit
    at their clamps, exactly like the official ``_calc_by_step`` loops, which
    store each row floored to a multiple of ``align``.
    """
    lo, hi = base // 2, base * 2
    h_end, w_end = (hi, lo) if dh > 0 else (lo, hi)
    rows, h, w = [], base, base
    while (h, w) != (h_end, w_end):
        h = min(max(h + dh * step, lo), hi)
        w = min(max(w - dh * step, lo), hi)
        rows.append((h // align * align, w // align * align))
    return rows


@lru_cache(maxsize=8)
def ratio_table(base: int = BASE_SIZE, step: int | None = None, align: int = 1) -> Table:
    """The official sorted ratio rows (height, width); index = ratio token k. ``step`` defaults to base // 16."""
    step = base // 16 if step is None else step
    if base % align or not align <= step <= base // 2:
        raise ValueError(f"ratio table: need base % align == 0 and align <= step <= base/2 "
                         f"(base {base}, step {step}, align {align})")
    rows = [(base, base)] + _walk(base, step, +1, align) + _walk(base, step, -1, align)
    return tuple(sorted(rows, key=lambda hw: hw[0] / hw[1]))


RESOLUTIONS: Table = ratio_table(BASE_SIZE, STEP)
"""33 rows, k = 0 (512x2048, widest) .. 16 (1024x1024) .. 32 (2048x512, tallest)."""

INSTRUCT_EXTRA: Table = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))
"""Rows the Instruct checkpoints append unsorted after the sorted ones (k = 33..36), whatever the base size."""


def instruct_table(base_size: int = BASE_SIZE) -> Table:
    """The Instruct ``vae_reso_group``: sorted rows of ``base_size`` plus the absolute extras.

    As in the official ``ResolutionGroup``, an extra row is appended only if
    no row already in the table has exactly its H/W.
    """
    table = list(ratio_table(base_size, align=INSTRUCT_ALIGN))
    for h, w in INSTRUCT_EXTRA:
        if all(th / tw != h / w for th, tw in table):
            table.append((h, w))
    return tuple(table)


def rows(extra: bool = False, base: int = BASE_SIZE) -> Table:
    """The addressable rows: 33 for the base model, 37 with the Instruct extras.

    ``base`` is the checkpoint's ``image_base_size`` (the official base code
    builds its table from it too; the embedded tiny model draws at 256).
    """
    table = RESOLUTIONS if base == BASE_SIZE else ratio_table(base)
    return table + INSTRUCT_EXTRA if extra else table


def nearest(table: Table, height: int, width: int) -> int:
    """Index of the row whose H/W is nearest ``height/width``; ties go to the lower index (``np.argmin``)."""
    if height <= 0 or width <= 0:
        raise ValueError(f"bad image size {height}x{width} (HxW): sides must be positive")
    ratio = height / width
    return min(range(len(table)), key=lambda i: abs(table[i][0] / table[i][1] - ratio))


def snap(height: int, width: int, *, extra: bool = False, base: int = BASE_SIZE) -> tuple[int, int, int]:
    """Snap a requested size to the nearest-ratio row of the ``base`` table: (k, h_px, w_px).

    Ties go to the lower k (``np.argmin`` semantics). ``extra=True`` also
    considers the Instruct rows k 33..36.
    """
    table = rows(extra, base)
    k = nearest(table, height, width)
    return (k, *table[k])


def _parse_request(request: str | Sequence[int], table: Table) -> tuple[int, int]:
    """(H, W) of an Instruct size request: 'HxW', 'W:H' (note the order), '<img_ratio_k>' or (H, W)."""
    if not isinstance(request, str):
        if len(request) != 2 or not all(isinstance(s, int) for s in request):
            raise ValueError(f"image size {request!r}: expected (H, W) as two integers")
        return request[0], request[1]
    try:
        if request.startswith("<img_ratio_"):
            k = int(request.split("_")[-1].rstrip(">"))
            if not 0 <= k < len(table):
                raise ValueError(f"ratio index {k} outside the {len(table)}-row table")
            return table[k]
        sep = "x" if "x" in request else ":" if ":" in request else None
        parts = [int(s) for s in request.split(sep)] if sep else []
    except ValueError as e:
        raise ValueError(f"image size {request!r}: {e}") from None
    if len(parts) != 2:
        raise ValueError(f"image size {request!r}: expected 'HxW', 'W:H' or '<img_ratio_k>'")
    return (parts[0], parts[1]) if sep == "x" else (parts[1], parts[0])


def instruct_size(request: str | Sequence[int], base_size: int = BASE_SIZE, factor: int = 16) -> tuple[int, int, int]:
    """The Instruct image-size rule (official ``build_gen_image_info``): (h_px, w_px, ratio_index).

    'HxW' is (H, W), 'A:B' is W:H (unlike the base code), '<img_ratio_k>'
    picks row k; the size is then ALWAYS snapped to the nearest-ratio row of
    ``instruct_table(base_size)``, so only the aspect of a request matters.
    ``factor`` is the VAE factor times the patch size: the token grid is
    ``token_grid(h, w, factor)``, and a row smaller than one token is refused.
    """
    table = instruct_table(base_size)
    k = nearest(table, *_parse_request(request, table))
    h, w = table[k]
    token_grid(h, w, factor)
    return h, w, k


def token_grid(h_px: int, w_px: int, downsample: int) -> tuple[int, int]:
    """Latent token grid (th, tw) for an image: floor division by the VAE factor.

    ``downsample`` is vae_downsample_factor * patch_size (16 for the released
    model). Floor, not ceil, because the official ``build_image_info`` floors.
    """
    th, tw = h_px // downsample, w_px // downsample
    if th < 1 or tw < 1:
        raise ValueError(f"image {h_px}x{w_px} (HxW) is smaller than one token at downsample {downsample}")
    return th, tw
