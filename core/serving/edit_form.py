"""The multipart/form-data body of ``POST /v1/images/edits``: text fields apart from the image files.

The official ``openai`` client sends one image as a file part ``image`` and a
list as repeated ``image[]`` parts; curl users write ``-F image=@a.png`` (or
``image[]``, ``image[0]``, ...). All of them are the reference images, in the
order they arrive, and are named ``image[0]``, ``image[1]``, ... in errors.
Every other part is a text field (its value a string, validated by the
pydantic schema in lax mode); ``mask`` and ``markup`` are refused by name:
this model edits the whole image from the prompt.
"""
from __future__ import annotations

import re

from fastapi import Request
from starlette.datastructures import Headers, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from .errors import APIError
from .validation import read_body

IMAGE_FIELD = re.compile(r"image(\[\d*\])?")
REFUSED_PARTS = {
    "mask": "mask is not supported: this model edits the whole image as the prompt says (there is no inpainting "
            "mask); describe the region to change in the prompt",
    "markup": "markup is not supported: describe the change in the prompt",
}
MAX_FIELD_BYTES = 256 << 10  # one text field (the prompt is limited further by serving's max_prompt_chars)
MAX_PARTS = 64


class EditForm:
    """The text fields (name -> value, each given once) and the image files ``[(part name, bytes)]`` in order."""

    def __init__(self):
        self.fields: dict[str, str] = {}
        self.images: list[tuple[str, bytes]] = []

    def values(self) -> dict[str, str]:
        """The fields for the schema: an empty one is not given (``-F size=``, the SDK's None), but for the prompt."""
        return {k: v for k, v in self.fields.items() if v != "" or k == "prompt"}


async def read_edit_form(request: Request, limit: int) -> EditForm:
    """The form of an edit request; 400 for a body that is not multipart/form-data or cannot be parsed."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise APIError(400, f"/v1/images/edits takes multipart/form-data (got {content_type or 'no content type'!r}); "
                            "send the images as file parts, e.g. curl -F 'image[]=@a.png' -F prompt=...",
                       param="image", code="invalid_content_type")
    raw = await read_body(request, limit)
    items = await _parse(request.headers, raw)
    form = EditForm()
    for name, value in items:
        await _add(form, name, value)
    return form


async def _parse(headers: Headers, raw: bytes) -> list[tuple[str, str | UploadFile]]:
    async def stream():
        yield raw

    parser = MultiPartParser(headers, stream(), max_files=MAX_PARTS, max_fields=MAX_PARTS,
                             max_part_size=MAX_FIELD_BYTES)
    try:
        return list((await parser.parse()).multi_items())
    except MultiPartException as e:
        raise APIError(400, f"malformed multipart/form-data body: {e.message}", code="invalid_multipart") from None


async def _add(form: EditForm, name: str, value: str | UploadFile) -> None:
    """One part into ``form``: an image file, a text field, or a 400 naming the part."""
    if name in REFUSED_PARTS:
        raise APIError(400, REFUSED_PARTS[name], param=name, code="unsupported_parameter")
    if IMAGE_FIELD.fullmatch(name):
        part = f"image[{len(form.images)}]"
        if isinstance(value, str):
            raise APIError(400, f"{part}: expected a file upload (curl: -F '{name}=@photo.png'), got a text field",
                           param=part)
        form.images.append((part, await value.read()))
        await value.close()
        return
    if not isinstance(value, str):
        await value.close()
        raise APIError(400, f"{name}: unexpected file upload; only image / image[] parts carry files", param=name)
    if name in form.fields:
        raise APIError(400, f"{name} is given more than once", param=name)
    form.fields[name] = value
