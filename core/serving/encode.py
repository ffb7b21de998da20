"""Image bytes for responses: uint8 ``[H, W, 3]`` -> PNG / JPEG / WebP (no web-stack imports)."""
from __future__ import annotations

import io


def encode_image(image_HW3, fmt: str = "png", quality: int | None = None) -> bytes:
    """PNG at a moderate zlib level (speed over size); JPEG / WebP at ``quality`` (default 90)."""
    from PIL import Image

    buf = io.BytesIO()
    img = Image.fromarray(image_HW3)
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=4)
    else:
        img.save(buf, format=fmt.upper(), quality=90 if quality is None else quality)
    return buf.getvalue()
