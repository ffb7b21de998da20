"""Tiled VAE decode (and encode): bounded activation memory, tiles spread over ranks.

The latent is cut into overlapping square tiles; each tile is decoded on its
own and written into the image with a feathered weight that ramps linearly
across the overlap (only on sides that have a neighbour), then the weighted
sum is normalised. Tiles are independent, so a rank decodes only the tiles it
owns (``tile_index % world == rank``) and one all-reduce of the partial sums
gives every rank the whole image. The mid-block attention of the VAE is
global, so a tiled image differs slightly from an untiled one; the tests
bound that difference and keep the tiled result identical across world sizes.

On a device with streams, ``TileLanes`` decodes a rank's tiles on several
side streams at once (tile k on lane k % n) while the caller's stream blends
them in order; each lane holds one tile's activations, so memory grows with
the lane count. A lane starts its next tile only after the caller's stream
has blended its previous one, so a decoder may return a buffer it reuses
(a graph's static output) as long as it keeps one per lane (``lanes.current``).

``tiled_encode`` is the mirror image on one process: the pixels are cut
along the same latent-unit grid, each tile is encoded on its own, and the
latent tiles are blended with the same feathered weights at latent
resolution (ramp = ``overlap`` latents).

Shape suffixes: B batch, C latent channels, h/w latent rows/cols, H/W pixels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Tile:
    y0: int
    y1: int
    x0: int
    x1: int


def _starts(n: int, tile: int, stride: int) -> list[int]:
    """Tile origins along one axis covering ``[0, n)``; the last tile is flush with the end."""
    if n <= tile:
        return [0]
    starts = list(range(0, n - tile + 1, stride))
    return starts if starts[-1] + tile >= n else starts + [n - tile]


def tile_grid(h: int, w: int, tile: int, overlap: int) -> list[Tile]:
    """Row-major tiles of side ``tile`` overlapping by at least ``overlap`` latents."""
    stride = tile - overlap
    return [Tile(y, min(y + tile, h), x, min(x + tile, w))
            for y in _starts(h, tile, stride) for x in _starts(w, tile, stride)]


def _ramp(n: int, ramp: int, lo: bool, hi: bool) -> torch.Tensor:
    """1-D weights: linear in (0, 1] over ``ramp`` pixels at the ends that border a neighbour."""
    i = torch.arange(n, dtype=torch.float32) + 0.5
    w = torch.ones(n)
    if lo and ramp:
        w = torch.minimum(w, i / ramp)
    if hi and ramp:
        w = torch.minimum(w, (n - i) / ramp)
    return w


def tile_weight(t: Tile, h: int, w: int, overlap: int, factor: int) -> torch.Tensor:
    """Pixel weights ``[H_t, W_t]`` of one tile (feathered toward inner neighbours)."""
    ramp = overlap * factor
    wy = _ramp((t.y1 - t.y0) * factor, ramp, t.y0 > 0, t.y1 < h)
    wx = _ramp((t.x1 - t.x0) * factor, ramp, t.x0 > 0, t.x1 < w)
    return wy[:, None] * wx[None, :]


class TileLanes:
    """Side streams that decode tiles concurrently; the caller's stream consumes each result in order.

    ``services`` is the worker's ``DeviceServices``; with ``count`` <= 1 or no
    streams (the CPU) tiles run one after another on the caller's stream.
    """

    def __init__(self, services=None, count: int = 1):
        streams = [services.stream() for _ in range(count)] if services is not None and count > 1 else []
        self.services, self.streams = services, [s for s in streams if s is not None]
        self.current = 0  # the lane whose stream is current while ``decode`` runs
        self._start, self._consumed = None, {}

    def begin(self) -> None:
        """Mark where the inputs are ready on the caller's stream; lanes wait for this point once."""
        self._start, self._consumed = self._mark(None), {}

    def decode(self, k: int, decode: Callable, z_tile: torch.Tensor) -> torch.Tensor:
        """Tile ``k`` on lane ``k % n``; the caller's stream waits for its result (the host does not)."""
        if not self.streams:
            return decode(z_tile)
        self.current = k % len(self.streams)
        lane = self.streams[self.current]
        for ev in (self._start, self._consumed.get(self.current)):
            if ev is not None:
                lane.wait_event(ev)
        with self.services.use_stream(lane):
            out = decode(z_tile)
            done = self._mark(lane)
        self.services.current_stream().wait_event(done)
        return out

    def consumed(self, k: int) -> None:
        """The caller's stream has read tile ``k``'s result: its lane may overwrite it now."""
        if self.streams:
            self._consumed[k % len(self.streams)] = self._mark(None)

    def _mark(self, stream):
        if not self.streams:
            return None
        ev = self.services.event()
        ev.record(stream) if stream is not None else ev.record()
        return ev


def tiled_decode(decode: Callable[[torch.Tensor], torch.Tensor], z_BChw: torch.Tensor, *, tile: int, overlap: int,
                 factor: int, rank: int = 0, world: int = 1,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 lanes: TileLanes | None = None) -> torch.Tensor:
    """Decode ``z`` tile by tile with ``decode`` (latents -> pixels); ranks split the tiles, lanes overlap them."""
    B, _, h, w = z_BChw.shape
    lanes = lanes or TileLanes()
    lanes.begin()
    blend = _Blend((h * factor, w * factor))
    mine = [t for i, t in enumerate(tile_grid(h, w, tile, overlap)) if i % world == rank]
    for k, t in enumerate(mine):
        x_B3HW = lanes.decode(k, decode, z_BChw[:, :, t.y0:t.y1, t.x0:t.x1])
        blend.add(x_B3HW, t, tile_weight(t, h, w, overlap, factor), factor)
        lanes.consumed(k)
    acc, wsum = blend.acc, blend.wsum
    if all_reduce is not None:
        acc, wsum = _reduce_partial(acc, wsum, B, h * factor, w * factor, z_BChw.device, all_reduce)
    return acc / wsum


def tiled_encode(encode: Callable[[torch.Tensor], torch.Tensor], x_B3HW: torch.Tensor, *, tile: int,
                 overlap: int, factor: int) -> torch.Tensor:
    """Encode ``x`` tile by tile with ``encode`` (pixels -> ``[B, C, H_t/factor, W_t/factor]``); fp32 result.

    ``tile`` and ``overlap`` are in latents; H and W must be multiples of ``factor``.
    Whatever ``encode`` returns per latent position (a mean, or stacked moments) is blended linearly.
    """
    H, W = x_B3HW.shape[-2:]
    if H % factor or W % factor:
        raise ValueError(f"image {H}x{W} (HxW) is not a multiple of the VAE factor {factor}")
    h, w = H // factor, W // factor
    blend = _Blend((h, w))
    for t in tile_grid(h, w, tile, overlap):
        z_BCht = encode(x_B3HW[:, :, t.y0 * factor:t.y1 * factor, t.x0 * factor:t.x1 * factor])
        blend.add(z_BCht, t, tile_weight(t, h, w, overlap, 1), 1)
    return blend.acc / blend.wsum


class _Blend:
    """The feathered weighted sum of overlapping tile outputs over a ``size`` canvas (fp32), and its weights."""

    def __init__(self, size: tuple[int, int]):
        self.size = size
        self.acc = self.wsum = None

    def add(self, x_BCHW: torch.Tensor, t: Tile, weight: torch.Tensor, scale: int) -> None:
        """Add tile ``t``'s output (``scale`` canvas pixels per tile-grid unit) with its feathered ``weight``."""
        if self.acc is None:
            self.acc = x_BCHW.new_zeros(x_BCHW.shape[0], x_BCHW.shape[1], *self.size, dtype=torch.float32)
            self.wsum = x_BCHW.new_zeros(1, 1, *self.size, dtype=torch.float32)
        wt = weight.to(x_BCHW.device)
        ys, xs = slice(t.y0 * scale, t.y1 * scale), slice(t.x0 * scale, t.x1 * scale)
        self.acc[:, :, ys, xs] += x_BCHW.float() * wt
        self.wsum[:, :, ys, xs] += wt


def _reduce_partial(acc, wsum, B, H, W, device, all_reduce):
    """Sum partial images over ranks (a rank with no tile contributes zeros)."""
    if acc is None:
        acc, wsum = torch.zeros(B, 3, H, W, device=device), torch.zeros(1, 1, H, W, device=device)
    return all_reduce(acc), all_reduce(wsum)
