"""The size contract's last step: the model's native image to exactly the size the caller asked for.

A model generates at its own sizes (HunyuanImage-3 snaps every request to
the nearest row of its aspect table); the caller gets exactly what it asked
for. Where the native aspect differs from the requested one, the native
image is centre-cropped to the requested aspect first (nothing is
stretched), then resampled with Lanczos (Pillow's highest-quality filter).
No web-stack imports: the CLI uses it too.
"""
from __future__ import annotations

import numpy as np


def fit_image(image_HW3: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 ``[height, width, 3]``: ``image_HW3`` centre-cropped to that aspect, then Lanczos-resampled."""
    h, w = image_HW3.shape[:2]
    if (h, w) == (height, width):
        return image_HW3
    from PIL import Image

    box = crop_box(h, w, height, width)
    img = Image.fromarray(np.ascontiguousarray(image_HW3))
    return np.asarray(img.resize((width, height), Image.Resampling.LANCZOS, box=box))


def crop_box(h: int, w: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the largest centred ``height:width`` window in an ``h x w`` image."""
    if w * height > h * width:  # native is wider than asked: crop the sides
        keep = h * width / height
        left = (w - keep) / 2
        return round(left), 0, round(left + keep), h
    keep = w * height / width  # taller (or the same aspect): crop top and bottom
    top = (h - keep) / 2
    return 0, round(top), w, round(top + keep)
