"""omni.serving.png: our PNG writer, checked against Pillow's decoder, stdlib zlib and a per-byte reference."""
from __future__ import annotations

import io
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from omni.serving import png
from omni.serving.encode import encode_image
from omni.serving.png import encode_png

BACKENDS = ["isal", "zlib"] if png.isal_zlib is not None else ["zlib"]


# ------------------------------------------------------------------ helpers


def random_image(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def photo_like(height, width, channels=3, seed=0) -> np.ndarray:
    """Smooth gradients plus a little noise: every filter and compressor has something to do."""
    y, x = np.mgrid[0:height, 0:width]
    base_HW = 128 + 60 * np.sin(x / 9.0) * np.cos(y / 13.0) + (x + 2 * y) % 64
    noise = np.random.default_rng(seed).integers(-3, 4, (height, width, channels))
    return np.clip(base_HW[:, :, None] + noise, 0, 255).astype(np.uint8)


def decoded(blob: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(blob)) as img:
        img.load()  # decodes every IDAT, checking their CRCs and the zlib stream
        return np.asarray(img)


def png_chunks(blob: bytes) -> list[tuple[bytes, bytes, int]]:
    """(type, data, stored CRC) of every chunk, after checking the signature."""
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, pos = [], 8
    while pos < len(blob):
        (length,) = struct.unpack(">I", blob[pos:pos + 4])
        kind, data = blob[pos + 4:pos + 8], blob[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", blob[pos + 8 + length:pos + 12 + length])
        chunks.append((kind, data, crc))
        pos += 12 + length
    assert pos == len(blob)
    return chunks


def zlib_stream(blob: bytes) -> bytes:
    return b"".join(data for kind, data, _ in png_chunks(blob) if kind == b"IDAT")


def scanlines(blob: bytes) -> bytes:
    """The filtered scanlines; stdlib zlib.decompress checks the header's FCHECK and the Adler-32."""
    return zlib.decompress(zlib_stream(blob))


def filter_types(blob: bytes, height: int) -> list[int]:
    raw = scanlines(blob)
    stride = len(raw) // height
    return [raw[row * stride] for row in range(height)]


def paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def reference_scanlines(image_HWC: np.ndarray) -> bytes:
    """The PNG filters and libpng's minimum-sum-of-|int8| choice, one byte at a time (ties: the lower type)."""
    height, width, bpp = image_HWC.shape
    rows = [list(map(int, row)) for row in image_HWC.reshape(height, width * bpp)]
    out, above = bytearray(), [0] * (width * bpp)
    for row in rows:
        left = [0] * bpp + row[:-bpp]
        up_left = [0] * bpp + above[:-bpp]
        predictions = [[0] * len(row), left, above, [(a + b) // 2 for a, b in zip(left, above)],
                       [paeth(a, b, c) for a, b, c in zip(left, above, up_left)]]
        candidates = [[(x - p) % 256 for x, p in zip(row, pred)] for pred in predictions]
        costs = [sum(min(v, 256 - v) for v in cand) for cand in candidates]
        best = min(range(5), key=lambda t: costs[t])
        out += bytes([best] + candidates[best])
        above = row
    return bytes(out)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 40, 3), (40, 1, 3), (17, 33, 3), (17, 33), (17, 33, 1),
                                   (17, 33, 4), (1, 1, 4), (5, 1), (301, 257, 3)])
def test_round_trips_bit_exactly_through_pillow(shape):
    image = random_image(shape)
    for chunks in (None, 1, 3):
        out = decoded(encode_png(image, 4, chunks=chunks))
        assert out.dtype == np.uint8 and np.array_equal(out, image.reshape(out.shape)), (shape, chunks)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", range(10))
def test_every_level_and_backend_is_lossless(level, backend):
    for image in (photo_like(67, 45), random_image((9, 31, 4), seed=level), photo_like(40, 30, 1)):
        for chunks in (1, 4):
            blob = encode_png(image, level, chunks=chunks, backend=backend)
            assert np.array_equal(decoded(blob), image.squeeze()), (image.shape, chunks)


def test_channels_map_to_png_colour_types():
    for shape, mode, colour_type in [((4, 6), "L", 0), ((4, 6, 1), "L", 0), ((4, 6, 3), "RGB", 2),
                                     ((4, 6, 4), "RGBA", 6)]:
        blob = encode_png(random_image(shape), 1)
        ihdr = png_chunks(blob)[0]
        assert ihdr[0] == b"IHDR" and struct.unpack(">IIBBBBB", ihdr[1]) == (6, 4, 8, colour_type, 0, 0, 0)
        with Image.open(io.BytesIO(blob)) as img:
            assert img.mode == mode and img.size == (6, 4)


def test_any_array_like_and_non_contiguous_views():
    image = photo_like(20, 30)
    assert np.array_equal(decoded(encode_png(Image.fromarray(image), 2)), image)  # via its __array_interface__
    flipped = image[::-1, ::2]  # a strided view
    assert np.array_equal(decoded(encode_png(flipped, 2)), flipped)


# ------------------------------------------------------------------ filtering


def test_filtered_bytes_equal_a_per_byte_reference():
    """Sub / Up / Average / Paeth arithmetic, the choice (0x80 costs 128) and its ties, on every channel count."""
    for image in (random_image((7, 11, 3)), photo_like(9, 10, 4), photo_like(12, 5, 1),
                  np.full((3, 4, 3), 0x80, np.uint8)):
        assert scanlines(encode_png(image, 1)) == reference_scanlines(image), image.shape


def crafted_filter_rows(width: int, bpp: int = 3) -> tuple[np.ndarray, list[int]]:
    """Random rows, each followed by a row that one filter turns into (nearly) all zeros or sevens or ones:
    (image, the filter types those rows must get)."""
    rng = np.random.default_rng(5)
    rows, expected = [], []
    for kind in range(5):
        above = rng.integers(0, 256, width * bpp).astype(int)
        row = [0] * (width * bpp)  # kind 0: all zeros (None and Sub tie at 0: the lower type wins)
        for i in range(width * bpp):
            a = row[i - bpp] if i >= bpp else 0
            c = above[i - bpp] if i >= bpp else 0
            if kind == 1:
                row[i] = (a + 7) % 256 if i >= bpp else int(rng.integers(0, 256))  # Sub: all 7
            elif kind == 2:
                row[i] = (above[i] + 1) % 256  # Up: all 1
            elif kind == 3:
                row[i] = (a + above[i]) // 2  # Average: all 0
            elif kind == 4:  # Paeth: 0 after the first pixel (random, else every prediction is the byte above)
                row[i] = paeth(a, above[i], c) if i >= bpp else int(rng.integers(0, 256))
        rows += [above, row]
        expected.append(kind)
    return np.array(rows, np.uint8).reshape(10, width, bpp), expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_filter_type_is_chosen_where_it_wins(backend):
    image, expected = crafted_filter_rows(64)
    blob = encode_png(image, 4, backend=backend)
    types = filter_types(blob, len(image))
    assert types[1::2] == expected and set(types) == {0, 1, 2, 3, 4}
    assert np.array_equal(decoded(blob), image)


def test_level_0_stores_unfiltered_rows():
    image = photo_like(16, 16)
    raw = scanlines(encode_png(image, 0))
    assert raw == b"".join(b"\x00" + row.tobytes() for row in image.reshape(16, -1))


# ------------------------------------------------------------------ the zlib stream and the chunks


@pytest.mark.parametrize("backend", BACKENDS)
def test_zlib_header_and_checksums(backend):
    image = photo_like(300, 280)  # > 256 KiB: several chunks by default
    for level in range(10):
        blob = encode_png(image, level, chunks=5, backend=backend)
        stream = zlib_stream(blob)
        cmf, flg = stream[0], stream[1]
        assert cmf == 0x78 and (cmf << 8 | flg) % 31 == 0 and not flg & 0x20, level  # no preset dictionary
        assert flg >> 6 == (0, 0, 1, 1, 1, 1, 2, 3, 3, 3)[level]  # as zlib writes it for that level
        assert struct.unpack(">I", stream[-4:])[0] == zlib.adler32(scanlines(blob))  # decompress checked it too
        for kind, data, crc in png_chunks(blob):
            assert crc == zlib.crc32(kind + data), kind
        assert [kind for kind, _, _ in png_chunks(blob)] == [b"IHDR", b"IDAT", b"IEND"]


def test_adler32_combine_matches_zlib():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    for cut in (0, 1, 5552, 65521, 131_072, len(data)):
        a, b = data[:cut], data[cut:]
        assert png._adler32_combine(zlib.adler32(a), zlib.adler32(b), len(b)) == zlib.adler32(data), cut


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_streams_hold_the_same_scanlines(backend):
    image = photo_like(301, 257, 3)
    one = scanlines(encode_png(image, 4, chunks=1, backend=backend))
    for chunks in (2, 3, 7, 8, 301, 1000):  # more chunks than rows: one row each
        assert scanlines(encode_png(image, 4, chunks=chunks, backend=backend)) == one, chunks
    first_rows = reference_scanlines(image[:12])  # a row's filter depends on it and the row above only
    assert one[:len(first_rows)] == first_rows


def test_huge_streams_split_into_several_idat_chunks(monkeypatch):
    monkeypatch.setattr(png, "MAX_IDAT_BYTES", 1000)
    image = random_image((40, 50, 3))
    blob = encode_png(image, 1)
    idats = [data for kind, data, _ in png_chunks(blob) if kind == b"IDAT"]
    assert len(idats) > 5 and all(len(d) <= 1000 for d in idats)
    assert np.array_equal(decoded(blob), image)


def test_default_chunks_by_size_and_cpus(monkeypatch):
    monkeypatch.setattr(png, "_usable_cpus", lambda: 16)
    assert png._chunk_count(None, np.zeros((200, 1000), np.uint8)) == 1  # < 256 KiB: no threads
    assert png._chunk_count(None, np.zeros((1024, 3072), np.uint8)) == 8
    monkeypatch.setattr(png, "_usable_cpus", lambda: 2)
    assert png._chunk_count(None, np.zeros((1024, 3072), np.uint8)) == 2
    assert png._chunk_count(50, np.zeros((7, 3), np.uint8)) == 7


def test_chunks_run_on_the_named_shared_pool():
    names = set()
    original = png._deflated_chunk

    def spy(*args):
        names.add(threading.current_thread().name)
        return original(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(png, "_deflated_chunk", spy)
        encode_png(photo_like(64, 64), 1, chunks=4)
    assert names and all(name.startswith("omni-png") for name in names)
    assert png._shared_pool() is png._shared_pool()


def test_concurrent_calls_give_the_same_bytes():
    images = [photo_like(200, 300, seed=s) for s in range(6)]
    expected = [encode_png(image, 4) for image in images]
    with ThreadPoolExecutor(6) as callers:
        assert list(callers.map(lambda im: encode_png(im, 4), images)) == expected


# ------------------------------------------------------------------ levels and back-ends


def raw_deflate(compressor, data: bytes) -> bytes:
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_level_keeps_the_shortest_of_its_compressors(backend):
    """One chunk: the deflate data is exactly the shortest of the level's compressors' outputs."""
    image = photo_like(64, 80)
    for level in range(10):
        blob = encode_png(image, level, chunks=1, backend=backend)
        data = scanlines(blob)
        outputs = [raw_deflate(png._new_compressor(*spec), data) for spec in png._compressors_for(level, backend)]
        assert zlib_stream(blob)[2:-4] == min(outputs, key=len), level


def test_level_tiers():
    zlib_level = lambda lv: ("zlib", lv, zlib.Z_DEFAULT_STRATEGY)  # noqa: E731
    assert png._compressors_for(0, "isal") == png._compressors_for(0, "zlib") == [png.STORED]
    assert png._compressors_for(2, "isal") == [png.ISAL_FAST]
    assert png._compressors_for(5, "isal") == [png.ISAL_FAST, png.ISAL_THOROUGH, png.RUNS]
    assert png._compressors_for(8, "isal") == [png.ISAL_FAST, png.ISAL_THOROUGH, png.RUNS, zlib_level(8)]
    assert png._compressors_for(2, "zlib") == [zlib_level(2)]  # zlib: the level passed through
    assert png._compressors_for(6, "zlib") == [zlib_level(6), png.RUNS]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_higher_level_is_never_longer(backend):
    for image in (photo_like(300, 300), np.tile(random_image((8, 8, 3)), (40, 40, 1))):
        sizes = [len(encode_png(image, level, backend=backend)) for level in (1, 4, 7)]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] < len(encode_png(image, 0)), sizes


def test_without_isal_everything_is_stdlib_zlib(monkeypatch):
    image = photo_like(120, 90)
    zlib_backend = encode_png(image, 1, backend="zlib")
    monkeypatch.setattr(png, "isal_zlib", None)  # as if python-isal were not installed
    assert png._checked_backend(None) == "zlib" and png._checksum_module() is zlib
    assert encode_png(image, 1) == zlib_backend  # the default falls back to zlib, checksums included
    assert np.array_equal(decoded(encode_png(image, 6, chunks=3)), image)
    with pytest.raises(ValueError, match="isal.*not installed"):
        encode_png(image, 1, backend="isal")


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("image, match", [
    (np.zeros((4, 4, 3), np.float32), "uint8.*float32"),
    (np.zeros((4, 4, 3), np.uint16), "uint8.*uint16"),
    (np.zeros((4, 4, 2), np.uint8), "1, 3, 4 channels.*\\(4, 4, 2\\)"),
    (np.zeros((4, 4, 5), np.uint8), "1, 3, 4 channels.*\\(4, 4, 5\\)"),
    (np.zeros((2, 4, 4, 3), np.uint8), "\\[H, W\\] or \\[H, W, C\\]"),
    (np.zeros(12, np.uint8), "\\[H, W\\] or \\[H, W, C\\]"),
    (np.zeros((0, 4, 3), np.uint8), "non-empty.*\\(0, 4, 3\\)"),
    (np.zeros((4, 0), np.uint8), "non-empty"),
])
def test_bad_images_are_refused_by_name(image, match):
    with pytest.raises(ValueError, match=match):
        encode_png(image, 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"level": 10}, "level must be an integer 0-9, got 10"), ({"level": -1}, "level"), ({"level": 1.5}, "level"),
    ({"level": True}, "level"), ({"level": 1, "chunks": 0}, "chunks must be an integer >= 1, got 0"),
    ({"level": 1, "chunks": 2.5}, "chunks must be an integer"),
    ({"level": 1, "backend": "lzma"}, "backend must be one of"),
])
def test_bad_options_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        encode_png(random_image((3, 3, 3)), **kwargs)


# ------------------------------------------------------------------ encode_image


def test_encode_image_png_is_our_writer_and_jpeg_webp_stay_on_pillow():
    image = photo_like(48, 64)
    assert encode_image(image, "png", None, 1) == encode_png(image, 1)
    assert encode_image(image) == encode_png(image, 4)  # PNG_LEVEL
    assert encode_image(image, "jpeg", 80).startswith(b"\xff\xd8\xff")
    assert encode_image(image, "webp").startswith(b"RIFF")
