"""Lossless PNG writer for uint8 ``[H, W, C]`` images (C = 1 grey, 3 RGB, 4 RGBA), multi-threaded.

Each scanline gets the PNG filter (None / Sub / Up / Average / Paeth) whose output has the smallest sum of
``|byte as int8|`` (libpng's heuristic), computed with numpy a block of rows at a time. The rows are split into
row-aligned chunks that are filtered and raw-deflated in a shared thread pool (numpy, zlib and ISA-L release the
GIL); each chunk but the last ends with a sync flush, so their concatenation is one valid deflate stream, which
gets the zlib header and the Adler-32 of all the filtered bytes. A chunk is deflated by one or more compressors
(more at higher levels: ISA-L from python-isal when it imports, zlib's run-length strategy, zlib) and keeps
the shortest result; the comment above ``STORED`` says which and why.
"""
from __future__ import annotations

import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

try:
    from isal import isal_zlib
except ImportError:  # the stdlib zlib does everything, only slower
    isal_zlib = None

SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_LEVEL = 4  # zlib level of PNG responses unless the recipe's serving.png_compress_level says otherwise
COLOUR_TYPE_BY_CHANNELS = {1: 0, 3: 2, 4: 6}  # 8-bit grey, RGB, RGBA
MAX_IDAT_BYTES = 2**31 - 1  # the PNG limit on one chunk's length
ONE_CHUNK_BELOW_BYTES = 256 << 10  # measured: about where a second chunk starts paying for the hand-off
# Each chunk starts with an empty deflate window; measured, 8-16 chunks cost 0-0.3% bytes at every level, so the
# chunks get no preset dictionary (zdict) of the previous chunk's last 32 KiB.
MAX_CHUNKS = 8
ROWS_PER_BLOCK = 32  # rows filtered at once: 16-64 are equally fast, 128+ ~2x slower (temporaries leave the cache)

# How each level deflates. Every chunk goes through each of its level's compressors and keeps the shortest output
# (each chunk is a deflate stream of its own, so the winners can differ from chunk to chunk); the tiers are
# cumulative, so a higher level never gives a longer chunk. Why, measured one thread at a time on the 3 MiB of
# filtered bytes of bench/bench_png.py's 1024x1024 RGB images (2-core x86 box; filtering itself takes ~11 ms):
# - ISA-L level 1 takes 1-10 ms, the fastest by far. Its level 2 gives the same bytes (+-0.1%); its level 3 is up
#   to 3% larger on photo-like images but finds the long matches level 1 misses (a repeated 32 px tile: 118 kB
#   instead of 1.6 MB). zlib level 1 takes 3-10x as long as ISA-L 1 for bytes as large or larger.
# - zlib's Z_RLE strategy (distance-1 matches only) takes ~25 ms and is 13-17% smaller than ISA-L, and 2-12%
#   smaller than zlib 6, on photo-like images, whose filtered residuals have few long repeats; but it is 2.4x
#   larger on text over a flat background, where LZ77 wins. Trying both keeps the better for ~2x the deflate time.
# - zlib 6-9 are 14-16% smaller than ISA-L on that text, at 20-300x the time on photo-like images.
# So levels 1-3: ISA-L 1 alone; 4-6: + ISA-L 3 + runs (the server's default, 4); 7-9: + zlib at the level.
# With the zlib backend (no ISA-L), zlib at the level itself stands in for the ISA-L compressors.
STORED = ("zlib", 0, zlib.Z_DEFAULT_STRATEGY)  # no compression; ISA-L has no stored-only level
RUNS = ("zlib", 1, zlib.Z_RLE)  # the zlib level makes no difference under Z_RLE
ISAL_FAST = ("isal", 1, zlib.Z_DEFAULT_STRATEGY)
ISAL_THOROUGH = ("isal", 3, zlib.Z_DEFAULT_STRATEGY)
TRY_RUNS_FROM_LEVEL = 4
TRY_ZLIB_LZ77_FROM_LEVEL = 7
# The zlib header's FLEVEL (RFC 1950: 0 fastest, 1 fast, 2 default, 3 maximum) as zlib itself writes it.
FLEVEL_BY_LEVEL = (0, 0, 1, 1, 1, 1, 2, 3, 3, 3)
BACKENDS = ("isal", "zlib")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def encode_png(image_HWC, level: int = PNG_LEVEL, *, chunks: int | None = None, backend: str | None = None) -> bytes:
    """PNG bytes of ``image_HWC`` (uint8, ``[H, W]`` or ``[H, W, C]`` with C in 1, 3, 4), lossless at every
    zlib ``level`` 0-9: a higher level spends more time for fewer bytes; 0 stores the rows uncompressed.
    ``chunks``: how many row ranges are deflated in parallel (default: by size and cores);
    ``backend``: "isal" or "zlib" (default: isal when it is installed)."""
    image_HWC, level = _checked_image(image_HWC), _checked_level(level)
    compressors = _compressors_for(level, _checked_backend(backend))
    height, width, channels = image_HWC.shape
    rows_HX = image_HWC.reshape(height, width * channels)
    idat = _zlib_stream(rows_HX, channels, level, _chunk_count(chunks, rows_HX), compressors)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, COLOUR_TYPE_BY_CHANNELS[channels], 0, 0, 0)
    return b"".join([SIGNATURE, _chunk(b"IHDR", ihdr), *_idat_chunks(idat), _chunk(b"IEND", b"")])


# ------------------------------------------------------------------ arguments


def _checked_image(image) -> np.ndarray:
    """``image`` as a C-contiguous uint8 ``[H, W, C]`` array, or ValueError saying what is wrong with it."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ValueError(f"PNG needs a uint8 image, got dtype {image.dtype}")
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[2] not in COLOUR_TYPE_BY_CHANNELS:
        raise ValueError(f"PNG needs an [H, W] or [H, W, C] image with C in 1, 3, 4 channels, got shape {image.shape}")
    if image.shape[0] == 0 or image.shape[1] == 0:
        raise ValueError(f"PNG needs a non-empty image, got shape {image.shape}")
    return np.ascontiguousarray(image)


def _checked_level(level: int) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or not 0 <= level <= 9:
        raise ValueError(f"PNG compression level must be an integer 0-9, got {level!r}")
    return int(level)


def _checked_backend(backend: str | None) -> str:
    backend = backend or ("isal" if isal_zlib is not None else "zlib")
    if backend not in BACKENDS:
        raise ValueError(f"PNG deflate backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "isal" and isal_zlib is None:
        raise ValueError("PNG deflate backend 'isal' asked for, but python-isal is not installed")
    return backend


def _chunk_count(chunks: int | None, rows_HX: np.ndarray) -> int:
    if chunks is None:
        chunks = 1 if rows_HX.nbytes < ONE_CHUNK_BELOW_BYTES else min(MAX_CHUNKS, _usable_cpus())
    if not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"PNG chunks must be an integer >= 1, got {chunks!r}")
    return min(chunks, len(rows_HX))  # a chunk is at least one row


def _usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask where there is one: containers often pin fewer)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ------------------------------------------------------------------ the zlib stream, in parallel chunks


def _compressors_for(level: int, backend: str) -> list[tuple[str, int, int]]:
    """The (library, level, strategy) compressors whose shortest output each chunk keeps; each tier tries the
    tier below's and more, so a higher level never gives a longer chunk."""
    if level == 0:
        return [STORED]
    zlib_at_level = ("zlib", level, zlib.Z_DEFAULT_STRATEGY)
    if backend == "zlib":
        return [zlib_at_level] + ([RUNS] if level >= TRY_RUNS_FROM_LEVEL else [])
    compressors = [ISAL_FAST]
    if level >= TRY_RUNS_FROM_LEVEL:
        compressors += [ISAL_THOROUGH, RUNS]
    if level >= TRY_ZLIB_LZ77_FROM_LEVEL:
        compressors.append(zlib_at_level)
    return compressors


def _new_compressor(library: str, level: int, strategy: int):
    """A raw-deflate compressor (wbits -15: no zlib header or checksum, the stream gets one of each around all
    the chunks)."""
    if library == "isal":
        return isal_zlib.compressobj(level, isal_zlib.DEFLATED, -15)
    return zlib.compressobj(level, zlib.DEFLATED, -15, 8, strategy)


def _zlib_stream(rows_HX: np.ndarray, bpp: int, level: int, n_chunks: int, compressors) -> bytes:
    """zlib header + the chunks' deflate data in row order + big-endian Adler-32 of all the filtered bytes."""
    bounds = [len(rows_HX) * k // n_chunks for k in range(n_chunks + 1)]
    jobs = [(rows_HX, bounds[k], bounds[k + 1], bpp, level > 0, compressors, k == n_chunks - 1)
            for k in range(n_chunks)]
    if n_chunks == 1:  # no hand-off to the pool for small images
        results = [_deflated_chunk(*jobs[0])]
    else:
        results = [future.result() for future in [_shared_pool().submit(_deflated_chunk, *job) for job in jobs]]
    adler = 1
    for _, chunk_adler, length in results:
        adler = _adler32_combine(adler, chunk_adler, length)
    return b"".join([_zlib_header(level), *(data for data, _, _ in results), struct.pack(">I", adler)])


def _shared_pool() -> ThreadPoolExecutor:
    """One pool for every call, so concurrent requests share the cores instead of oversubscribing them (made
    lazily: importing this module starts no threads)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(MAX_CHUNKS, _usable_cpus()), thread_name_prefix="omni-png")
        return _pool


def _deflated_chunk(rows_HX, start: int, stop: int, bpp: int, filtered: bool, compressors, last: bool):
    """(raw deflate of rows start:stop, the shortest of ``compressors``' outputs; the Adler-32 of their filtered
    bytes; their length). It ends on a byte boundary (sync flush) unless it is the last chunk, so the next
    chunk's deflate data can follow it in the same stream."""
    deflaters = [_new_compressor(*spec) for spec in compressors]
    outputs = [[] for _ in deflaters]
    adler, length, checksums = 1, 0, _checksum_module()
    for block in _filtered_blocks(rows_HX, start, stop, bpp, filtered):
        for deflater, parts in zip(deflaters, outputs):
            parts.append(deflater.compress(block))
        adler, length = checksums.adler32(block, adler), length + block.nbytes
    end = zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH
    return min((b"".join([*parts, d.flush(end)]) for d, parts in zip(deflaters, outputs)), key=len), adler, length


def _checksum_module():
    """ISA-L's Adler-32 / CRC-32 when it is installed (the same functions, 5-8x faster on megabytes), else zlib's."""
    return isal_zlib if isal_zlib is not None else zlib


def _adler32_combine(adler_a: int, adler_b: int, length_b: int) -> int:
    """Adler-32 of bytes A + B from theirs (zlib's adler32_combine): A = 1 + sum of bytes, B = sum of the
    running A's, both mod 65521; appending ``length_b`` bytes adds ``length_b * (A_a - 1)`` to B."""
    base = 65521
    low_a, high_a, low_b, high_b = adler_a & 0xFFFF, adler_a >> 16, adler_b & 0xFFFF, adler_b >> 16
    low = (low_a + low_b - 1) % base
    high = (high_a + high_b + length_b * (low_a - 1)) % base
    return high << 16 | low


def _zlib_header(level: int) -> bytes:
    """CMF = deflate with a 32 KiB window; FLG = FLEVEL, no preset dictionary, FCHECK making it a multiple of 31."""
    cmf, flg = 0x78, FLEVEL_BY_LEVEL[level] << 6
    flg += (31 - (cmf << 8 | flg) % 31) % 31
    return bytes([cmf, flg])


# ------------------------------------------------------------------ filtering


def _filtered_blocks(rows_HX: np.ndarray, start: int, stop: int, bpp: int, filtered: bool):
    """Rows start:stop as filtered scanlines (filter byte + bytes), ``ROWS_PER_BLOCK`` rows at a time.
    Unfiltered (type None) when ``filtered`` is off: stored data gains nothing from filtering."""
    for top in range(start, stop, ROWS_PER_BLOCK):
        rows = rows_HX[top:min(top + ROWS_PER_BLOCK, stop)]
        if not filtered:
            yield np.concatenate([np.zeros((len(rows), 1), np.uint8), rows], axis=1)
            continue
        above = rows_HX[top - 1] if top else np.zeros_like(rows[0])
        yield _best_filtered(rows, above, bpp)


def _best_filtered(rows_hX: np.ndarray, above_X: np.ndarray, bpp: int) -> np.ndarray:
    """uint8 ``[h, 1 + X]``: each row under the filter minimising the sum of |filtered byte as int8|, after
    the filter-type byte. ``above_X`` is the row above the first one (zeros at the top of the image)."""
    up, left, up_left = _neighbours(rows_hX, above_X, bpp)
    candidates_5hX = np.empty((5,) + rows_hX.shape, np.uint8)  # filter types 0-4, in PNG's order
    candidates_5hX[0] = rows_hX
    np.subtract(rows_hX, left, out=candidates_5hX[1])
    np.subtract(rows_hX, up, out=candidates_5hX[2])
    np.subtract(rows_hX, (left >> 1) + (up >> 1) + (left & up & 1), out=candidates_5hX[3])  # floor((a+b)/2)
    np.subtract(rows_hX, _paeth_predictor(left, up, up_left), out=candidates_5hX[4])
    best_h = _cheapest_candidate(candidates_5hX)
    out_hX = np.empty((len(rows_hX), rows_hX.shape[1] + 1), np.uint8)
    out_hX[:, 0] = best_h
    out_hX[:, 1:] = candidates_5hX[best_h, np.arange(len(rows_hX))]
    return out_hX


def _neighbours(rows_hX: np.ndarray, above_X: np.ndarray, bpp: int):
    """(up, left, up-left) bytes of every byte: the same byte of the previous pixel / row; zeros off the image."""
    up = np.empty_like(rows_hX)
    up[0], up[1:] = above_X, rows_hX[:-1]
    left, up_left = np.zeros_like(rows_hX), np.zeros_like(rows_hX)
    left[:, bpp:], up_left[:, bpp:] = rows_hX[:, :-bpp], up[:, :-bpp]
    return up, left, up_left


def _cheapest_candidate(candidates_5hX: np.ndarray) -> np.ndarray:
    """Per row, the filter type whose bytes have the smallest sum of |byte as int8| (min(v, 256 - v) in uint8,
    which also counts 0x80 as 128, where np.abs on int8 would overflow to -128)."""
    magnitudes = np.minimum(candidates_5hX, np.negative(candidates_5hX))
    return magnitudes.sum(axis=2, dtype=np.uint32).argmin(axis=0)


def _paeth_predictor(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """PNG's Paeth predictor of left ``a``, up ``b``, up-left ``c``, in uint8 without branches (np.where with
    a data-dependent mask is ~100x slower per byte). With p = a + b - c: |p - a| = |b - c|, |p - b| = |a - c|,
    and |p - c| = |(b - c) + (a - c)| is their sum when b - c and a - c have the same sign, else their difference."""
    dist_a, dist_b = _abs_diff(b, c), _abs_diff(a, c)
    same_sign = (b >= c) == (a >= c)  # a tie at zero makes both formulas for |p - c| agree
    dist_c_if_opposite = _abs_diff(dist_a, dist_b)
    pick_a = (dist_a <= dist_b) & (same_sign | (dist_a <= dist_c_if_opposite))
    pick_b = same_sign | (dist_b <= dist_c_if_opposite)
    return _select(pick_a, a, _select(pick_b, b, c))


def _abs_diff(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.maximum(x, y) - np.minimum(x, y)


def _select(mask: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x where mask else y, by bit masking (True -> 0xFF)."""
    return y ^ ((x ^ y) & np.negative(mask.view(np.uint8)))


# ------------------------------------------------------------------ chunks


def _chunk(kind: bytes, data) -> bytes:
    """length, type, data, CRC-32 of type + data."""
    crc = _checksum_module().crc32(data, zlib.crc32(kind))
    return b"".join([struct.pack(">I", len(data)), kind, data, struct.pack(">I", crc)])


def _idat_chunks(stream: bytes) -> list[bytes]:
    """The zlib stream in IDAT chunks of at most ``MAX_IDAT_BYTES`` (one for any realistic image)."""
    view = memoryview(stream)
    return [_chunk(b"IDAT", view[i:i + MAX_IDAT_BYTES]) for i in range(0, len(stream), MAX_IDAT_BYTES)]
