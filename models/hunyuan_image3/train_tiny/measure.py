"""What a generated image shows: background colour, the shape region's dominant colour, its position.

Used by the quality gate (tests/test_quality_tiny.py) and the model card's
evaluation. The background is the median colour of a border frame; the shape
region is every pixel far from it; each is named by the nearest palette
colour of ``data.COLOURS``, and the region's centroid by the nearest anchor of
``data.ANCHORS``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .data import ANCHORS, COLOURS

FRAME = 0.04  # border width (fraction of the side) read as background
FAR = 80.0  # RGB distance from the background that counts as shape
MIN_AREA = 0.01  # a region smaller than this fraction of the image is "no shape"
_PALETTE = np.array(list(COLOURS.values()), dtype=np.float32)
_NAMES = list(COLOURS)


@dataclass(frozen=True)
class Reading:
    background: str
    colour: str | None  # None: no shape region found
    position: str | None
    area: float

    def matches(self, colour: str, position: str, background: str) -> bool:
        return (self.colour, self.position, self.background) == (colour, position, background)


def nearest_colour(rgb_N3: np.ndarray) -> np.ndarray:
    """Index into the palette of the nearest colour for each RGB row."""
    d_NP = ((rgb_N3[:, None, :].astype(np.float32) - _PALETTE[None]) ** 2).sum(-1)
    return d_NP.argmin(-1)


def read_image(img_HW3: np.ndarray) -> Reading:
    """The reading of one uint8 RGB image."""
    img = img_HW3.astype(np.float32)
    h, w, _ = img.shape
    f = max(1, int(FRAME * min(h, w)))
    border = np.concatenate([img[:f].reshape(-1, 3), img[-f:].reshape(-1, 3),
                             img[:, :f].reshape(-1, 3), img[:, -f:].reshape(-1, 3)])
    bg_rgb = np.median(border, axis=0)
    background = _NAMES[int(nearest_colour(bg_rgb[None])[0])]
    region_HW = np.sqrt(((img - bg_rgb) ** 2).sum(-1)) > FAR
    area = float(region_HW.mean())
    if area < MIN_AREA:
        return Reading(background, None, None, area)
    colour = _NAMES[int(np.bincount(nearest_colour(img[region_HW]), minlength=len(_NAMES)).argmax())]
    ys, xs = np.nonzero(region_HW)
    cx, cy = (xs.mean() + 0.5) / w, (ys.mean() + 0.5) / h
    position = min(ANCHORS, key=lambda k: (ANCHORS[k][0] - cx) ** 2 + (ANCHORS[k][1] - cy) ** 2)
    return Reading(background, colour, position, area)
