"""Reference images for editing: bytes from an upload, a data URI or a URL -> checked uint8 RGB ``[H, W, 3]``.

One decoder for the HTTP API (``/v1/images/edits``, chat ``image_url`` parts)
and for ``omni-run edit``, so both refuse the same inputs with the same words.
Every refusal is an ``ImageInputError`` naming the part (``image[1]``,
``messages[0].content[2]``, or a file name on the command line); the server
turns it into a 400 (413 for too many bytes), the CLI into exit status 2.

The rules, in the order they are checked:

- count: at most ``max_images`` images; none at all for a model that does not
  edit (``max_images`` 0);
- bytes: at most ``max_bytes`` encoded bytes per image (413 over HTTP);
- format: PNG, JPEG, WebP, GIF or BMP only (Pillow is asked for nothing else:
  formats such as EPS would run external programs on untrusted input);
- size, read from the header BEFORE any pixel is decoded (a decompression
  bomb is refused without being expanded): at most ``max_pixels`` pixels,
  each side at least ``MIN_SIDE`` pixels, aspect ratio at most ``MAX_ASPECT``:1
  (the model center-crops a reference to its aspect rows, and scaling a
  sliver up to cover one would take gigabytes);
- integrity: the whole image is decoded (``load()``) and PNG chunk checksums
  are verified; Pillow's ``ImageFile.LOAD_TRUNCATED_IMAGES`` is never set, so
  a truncated PNG or JPEG is refused instead of being padded with grey;
- mode (see ``MODES``): 8-bit modes are converted to RGB; alpha is composited
  onto WHITE (transparent pixels become white, not whatever colour the
  encoder left under them); 16-bit, 32-bit integer and float modes are
  refused, because Pillow's conversion to 8 bits clips instead of scaling.
  The EXIF orientation is applied (the picture the user sees is the one
  used) and of an animated image the first frame is taken.

No web-stack imports here (the CLI uses this module); ``fetch_url`` imports
httpx only when a remote URL is actually fetched.
"""
from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

import numpy as np

MAX_IMAGE_BYTES = 20 << 20  # encoded bytes per reference image
MAX_IMAGE_PIXELS = 4096 * 4096  # the default of the recipe field serving.max_image_pixels
MIN_SIDE = 16
MAX_ASPECT = 8.0
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
RGB_MODES = ("1", "L", "P", "RGB", "RGBX", "CMYK", "YCbCr")  # converted to RGB as they are
ALPHA_MODES = ("LA", "PA", "RGBA", "RGBa")  # composited onto white
MODES = {**{m: "converted to RGB" for m in RGB_MODES}, **{m: "alpha composited onto white" for m in ALPHA_MODES}}


class ImageInputError(ValueError):
    """A reference image (or the set of them) that is refused; ``part`` names it, ``status`` is the HTTP answer."""

    def __init__(self, part: str, message: str, status: int = 400):
        super().__init__(f"{part}: {message}")
        self.part, self.status = part, status


@dataclass(frozen=True)
class ImageRules:
    """What this deployment accepts: ``model`` names it in the refusal of a model that does not edit."""

    model: str
    max_images: int
    max_pixels: int = MAX_IMAGE_PIXELS
    max_bytes: int = MAX_IMAGE_BYTES


def check_count(parts: list[str], rules: ImageRules) -> None:
    """Refuse images for a model that takes none, and any image past ``max_images`` (each named by its part)."""
    if parts and rules.max_images == 0:
        raise does_not_edit(parts[0], rules.model)
    if len(parts) > rules.max_images:
        raise ImageInputError(parts[rules.max_images], f"{len(parts)} reference images given; model {rules.model} "
                                                       f"takes at most {rules.max_images}")


def does_not_edit(part: str, model: str) -> ImageInputError:
    """The refusal of any reference image by a model that does not edit (the base model)."""
    return ImageInputError(part, f"model {model} does not take reference images (it does not edit); "
                                 "use an Instruct flavour to edit images")


def decode_image(data: bytes, part: str, rules: ImageRules) -> np.ndarray:
    """``data`` (an encoded image) -> C-contiguous, writable uint8 ``[H, W, 3]`` RGB, or ``ImageInputError``
    naming ``part``."""
    from PIL import ImageOps

    if len(data) > rules.max_bytes:
        raise ImageInputError(part, f"the image is {len(data)} bytes; the limit is {rules.max_bytes} bytes per image",
                              status=413)
    if not data:
        raise ImageInputError(part, "the image is empty (0 bytes)")
    with _opened(data, part) as im:
        _check_size(im.size, part, rules)
        _check_mode(im, part)
    with _opened(data, part, verify=True):
        pass  # PNG: every chunk's checksum and the end chunk (a cut IDAT still "loads")
    with _opened(data, part) as im:
        try:
            im.load()
            rgb = _to_rgb(ImageOps.exif_transpose(im))
        except Exception as e:  # noqa: BLE001 - any decoder failure on untrusted bytes is the client's input
            raise ImageInputError(part, f"the {im.format} data could not be decoded ({_reason(e)}); "
                                        "is the file complete?") from None
    return np.array(rgb, dtype=np.uint8, order="C")  # a writable copy (Pillow's buffer view is read-only)


def decode_images(parts: list[tuple[str, bytes]], rules: ImageRules) -> tuple[np.ndarray, ...]:
    """Every ``(part, bytes)`` decoded in order, after the count check."""
    check_count([p for p, _ in parts], rules)
    return tuple(decode_image(data, part, rules) for part, data in parts)


def reference_size(helpers, image_HW3: np.ndarray) -> tuple[int, int]:
    """(height, width) to generate when no size is asked for: the first reference image's, snapped by the model."""
    h, w = image_HW3.shape[:2]
    return helpers.snap(int(h), int(w))


# ------------------------------------------------------------------ data URIs and URLs


def data_uri_bytes(uri: str, part: str, max_bytes: int) -> bytes:
    """The bytes of ``data:[<mediatype>][;base64],<data>`` (413 past ``max_bytes`` decoded bytes)."""
    header, comma, payload = uri.partition(",")
    if not comma:
        raise ImageInputError(part, "malformed data URI: expected 'data:image/png;base64,<data>'")
    if len(payload) > 4 * (max_bytes // 3 + 2):
        raise ImageInputError(part, f"data URI holds more than {max_bytes} bytes (the limit per image)", status=413)
    if header.lower().endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageInputError(part, f"data URI is not valid base64 ({e})") from None
    return unquote_to_bytes(payload)


async def fetch_url(url: str, part: str, max_bytes: int, timeout_s: float) -> bytes:
    """GET ``url`` with a timeout, reading at most ``max_bytes`` (413 past it); failures name the part."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=True, max_redirects=3) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ImageInputError(part, f"fetching {url} answered HTTP {response.status_code}")
                return await _read_capped(response, url, part, max_bytes)
    except httpx.TimeoutException:
        raise ImageInputError(part, f"fetching {url} timed out after {timeout_s:g}s") from None
    except httpx.HTTPError as e:
        raise ImageInputError(part, f"fetching {url} failed: {_reason(e)}") from None


async def _read_capped(response, url: str, part: str, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ImageInputError(part, f"{url} is {declared} bytes; the limit is {max_bytes} bytes per image", status=413)
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise ImageInputError(part, f"{url} is more than {max_bytes} bytes (the limit per image)", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------ decoding steps


class _opened:
    """``Image.open`` on the allowed formats, as a context manager; ``verify=True`` runs ``verify()`` too."""

    def __init__(self, data: bytes, part: str, verify: bool = False):
        self.data, self.part, self.verify, self.im = data, part, verify, None

    def __enter__(self):
        from PIL import Image

        try:
            self.im = Image.open(io.BytesIO(self.data), formats=FORMATS)
            if self.verify:
                self.im.verify()
        except Image.DecompressionBombError as e:
            raise ImageInputError(self.part, f"too many pixels ({_reason(e)})") from None
        except Image.UnidentifiedImageError:
            raise ImageInputError(self.part, f"not an image, or not one of {', '.join(FORMATS)} "
                                             f"({len(self.data)} bytes, starting {self.data[:8]!r})") from None
        except Exception as e:  # noqa: BLE001 - a broken header or chunk is the client's input
            raise ImageInputError(self.part, f"broken image data ({_reason(e)}); is the file complete?") from None
        return self.im

    def __exit__(self, *exc) -> None:
        if self.im is not None:
            self.im.close()


def _check_size(size: tuple[int, int], part: str, rules: ImageRules) -> None:
    w, h = size
    if w * h > rules.max_pixels:
        raise ImageInputError(part, f"{w}x{h} (WxH) is {w * h} pixels; the limit is {rules.max_pixels} "
                                    "(serving.max_image_pixels)")
    if min(w, h) < MIN_SIDE:
        raise ImageInputError(part, f"{w}x{h} (WxH) is too small: each side must be at least {MIN_SIDE} pixels")
    if max(w / h, h / w) > MAX_ASPECT:
        raise ImageInputError(part, f"{w}x{h} (WxH) has aspect ratio beyond {MAX_ASPECT:g}:1; crop it first")


def _check_mode(im, part: str) -> None:
    if im.mode not in MODES:
        raise ImageInputError(part, f"image mode {im.mode} is not accepted: 16-bit, 32-bit integer and float "
                                    "images are refused (convert it to 8-bit RGB); accepted modes: "
                                    f"{', '.join(MODES)}")


def _to_rgb(im):
    """8-bit RGB; an alpha channel (also a palette's transparency) is composited onto white."""
    from PIL import Image

    if im.mode == "P" and "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ALPHA_MODES:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return im.convert("RGB")


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
