"""The API's static bounds and the checks that need no web stack.

The server's schemas (pydantic) and validation read them, and so does the
CLI (``omni-run generate / edit / chat``), which checks its flags by the same
rules without importing pydantic or FastAPI: a 1-step 64x64 ``generate`` of
the embedded model took 4.01-4.03 s with them and 3.72-3.97 s without (three
runs each on the 2-core development machine).
"""
from __future__ import annotations

from .errors import APIError

MAX_N = 10  # OpenAI's limit for n
MAX_STEPS = 200
MAX_GUIDANCE = 30.0
MAX_SEED = 2**63 - MAX_N  # image i of n draws with seed + i, which must still fit a signed 64-bit int
OUTPUT_FORMATS = ("png", "jpeg", "webp")
BOT_TASKS = ("image", "recaption", "think", "think_recaption")  # all but "image" write a CoT first (Instruct)
COT_TASKS = BOT_TASKS[1:]
MAX_TEXT_TOKENS = 4096  # max_tokens of a text answer, cot_max_tokens of a CoT
MAX_TEMPERATURE = 2.0  # OpenAI's range for temperature
MIN_TEMPERATURE = 1e-4  # above 0: smaller ones overflow the float32 logits they divide (0 is greedy)
MIN_TOP_P = 1e-6  # smaller ones round to 0 in float32 and keep no token at all

MIN_SIDE, MAX_SIDE, MAX_ASPECT = 64, 4096, 4.0  # of the image returned (the model generates at its own sizes)
NATIVE_SIZES = ("auto", "native")  # the model's own size, untouched


def size_problem(h: int, w: int, max_side: int = MAX_SIDE) -> str | None:
    """Why a requested (h, w) is refused (the API's and the CLI's rule), or None."""
    if not (MIN_SIDE <= h <= max_side and MIN_SIDE <= w <= max_side):
        return f"{w}x{h} (WxH) is out of range: each side must be between {MIN_SIDE} and {max_side} pixels"
    if max(h / w, w / h) > MAX_ASPECT:
        return (f"{w}x{h} (WxH) has aspect ratio beyond {MAX_ASPECT:g}:1; the model generates between "
                f"1:{MAX_ASPECT:g} and {MAX_ASPECT:g}:1")
    return None


def check_unicode(value, path: str = "") -> None:
    """400 naming the first string (key or value) that is not valid Unicode, e.g. a lone surrogate."""
    if isinstance(value, str):
        if not _encodable(value):
            field = path or "body"
            raise APIError(400, f"{field}: the text is not valid Unicode (a lone surrogate such as \\ud800?)",
                           param=field, code="invalid_unicode")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, path)
            check_unicode(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{path}[{i}]")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
