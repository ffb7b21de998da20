"""PNG encode time and bytes: Pillow vs our writer (omni.serving.png), on CPU, 1024x1024 RGB.

    python bench/bench_png.py --json /tmp/png_bench.json

Images: seeded uniform noise (incompressible); docs/images/first_command.png upscaled to 1024x1024 by Pillow
(bicubic: smooth); the same plus seeded uniform +-3 noise (photo-like grain); and rendered text on a flat
background (where LZ77 beats run-length coding). Encoders: Pillow at zlib levels 1 and 4; ours at the same
levels, with the ISA-L and the zlib back-ends, in one chunk and in the default chunks (min(8, CPUs)). Every
output of ours is decoded by Pillow and compared bit for bit. Times are medians of --repeat calls after one
warm call. Runs in ~20 s on 2 cores.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from omni.serving import png

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_commit  # noqa: E402

SIZE = 1024
LEVELS = (1, 4)
DOCS_IMAGE = Path(__file__).resolve().parents[1] / "docs" / "images" / "first_command.png"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="timed calls per case (the median is reported)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    return ap.parse_args()


def test_images() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    with Image.open(DOCS_IMAGE) as src:
        smooth = np.asarray(src.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BICUBIC))
    grain = np.clip(smooth.astype(np.int16) + rng.integers(-3, 4, smooth.shape), 0, 255).astype(np.uint8)
    return {"noise": rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8), "smooth": smooth,
            "smooth+-3": grain, "text": text_image()}


def text_image() -> np.ndarray:
    canvas = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    draw = ImageDraw.Draw(canvas)
    for line in range(60):
        draw.text((20, 17 * line + 5), f"line {line}: the quick brown fox jumps over the lazy dog 0123456789 " * 2,
                  fill=(20, 20, 20))
    return np.asarray(canvas)


def pillow_png(image: np.ndarray, level: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=level)
    return buf.getvalue()


def median_ms(fn, repeat: int) -> tuple[float, bytes]:
    out = fn()  # warm: the thread pool, caches
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def cases(image: np.ndarray):
    """(encoder, level, backend, chunks, callable) of every configuration timed on ``image``."""
    default_chunks = png._chunk_count(None, image.reshape(SIZE, -1))
    backends = [b for b in png.BACKENDS if b != "isal" or png.isal_zlib is not None]
    for level in LEVELS:
        yield "pillow", level, "zlib", 1, lambda level=level: pillow_png(image, level)
        for backend in backends:
            for chunks in sorted({1, default_chunks}):
                yield "ours", level, backend, chunks, \
                    lambda level=level, backend=backend, chunks=chunks: png.encode_png(image, level, chunks=chunks,
                                                                                       backend=backend)


def measure(images: dict[str, np.ndarray], repeat: int) -> list[dict]:
    rows = []
    for name, image in images.items():
        for encoder, level, backend, chunks, fn in cases(image):
            ms, blob = median_ms(fn, repeat)
            if encoder == "ours":
                with Image.open(io.BytesIO(blob)) as img:
                    assert np.array_equal(np.asarray(img), image), (name, level, backend, chunks)
            rows.append(dict(image=name, encoder=encoder, level=level, backend=backend, chunks=chunks,
                             ms=round(ms, 2), bytes=len(blob)))
    return rows


def print_table(rows: list[dict]) -> None:
    pillow = {(r["image"], r["level"]): r for r in rows if r["encoder"] == "pillow"}
    print(f"{'image':10s} {'encoder':7s} {'level':>5s} {'backend':7s} {'chunks':>6s} {'ms':>8s} {'bytes':>9s} "
          f"{'x Pillow time':>13s} {'x Pillow bytes':>14s}")
    for r in rows:
        ref = pillow[r["image"], r["level"]]
        print(f"{r['image']:10s} {r['encoder']:7s} {r['level']:5d} {r['backend']:7s} {r['chunks']:6d} "
              f"{r['ms']:8.1f} {r['bytes']:9d} {r['ms'] / ref['ms']:13.2f} {r['bytes'] / ref['bytes']:14.3f}")


def main() -> int:
    args = parse()
    rows = measure(test_images(), args.repeat)
    print_table(rows)
    if args.json:
        isal_version = getattr(sys.modules.get("isal"), "__version__", None)
        args.json.write_text(json.dumps(dict(commit=git_commit(), cpus=png._usable_cpus(), os_cpu_count=os.cpu_count(),
                                             isal=isal_version, repeat=args.repeat, size=SIZE, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
