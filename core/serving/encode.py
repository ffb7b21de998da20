"""Image bytes for responses: uint8 ``[H, W, 3]`` -> PNG (our multi-threaded writer, ``png.py``) / JPEG / WebP
(Pillow). No web-stack imports."""
from __future__ import annotations

import io

from .png import PNG_LEVEL, encode_png


def encode_image(image_HW3, fmt: str = "png", quality: int | None = None, png_level: int = PNG_LEVEL) -> bytes:
    """PNG at zlib level ``png_level`` (lossless at every level: it trades time for bytes);
    JPEG / WebP at ``quality`` (default 90)."""
    if fmt == "png":
        return encode_png(image_HW3, png_level)
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image_HW3).save(buf, format=fmt.upper(), quality=90 if quality is None else quality)
    return buf.getvalue()
