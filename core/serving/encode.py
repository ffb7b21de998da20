"""Image bytes for responses: uint8 ``[H, W, 3]`` -> PNG / JPEG / WebP (no web-stack imports)."""
from __future__ import annotations

import io


PNG_LEVEL = 4  # zlib level of PNG responses unless the recipe's serving.png_compress_level says otherwise


def encode_image(image_HW3, fmt: str = "png", quality: int | None = None, png_level: int = PNG_LEVEL) -> bytes:
    """PNG at zlib level ``png_level`` (lossless at every level: it trades time for bytes);
    JPEG / WebP at ``quality`` (default 90)."""
    from PIL import Image

    buf = io.BytesIO()
    img = Image.fromarray(image_HW3)
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=png_level)
    else:
        img.save(buf, format=fmt.upper(), quality=90 if quality is None else quality)
    return buf.getvalue()
