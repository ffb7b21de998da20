"""/openapi.json that tells the truth about this deployment: request bodies, every status, /metrics as text.

The handlers read their own bodies (limits, depth and Unicode come before a
schema, see json_body.py), so FastAPI cannot infer the bodies: they are
added here from the pydantic models, then tightened with what this
deployment enforces (prompt length, the side range, n against the queue,
the bot tasks the model has, fields it refuses). A client generator or a
fuzzer reading it can reach generation, and what the schema allows is what
the server accepts. Rules JSON Schema cannot say are in descriptions instead:
the aspect ratio at most 4:1 (``size``), and what a reference image must be
(the edit form's ``image`` file parts, a chat's ``image_url``: the formats,
sides, pixels and aspect image_input.py holds them to, and the spellings of
several parts). How many files the edit form takes is stated exactly: its
``image`` is an array of 1..max_images files (repeated parts). The form's
``encoding`` names the image media types and the URL's
``format`` is IMAGE_URI_FORMAT, so that a fuzzer can draw real images for both
(tests/serving/fuzz_hooks.py does). How many image_url parts a chat may carry
over all its messages is stated exactly (``_at_most_images``).
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from omni.request import COT_BUDGET

from .image_input import FORMATS, MAX_ASPECT as IMAGE_MAX_ASPECT, MIN_SIDE as IMAGE_MIN_SIDE
from .options import ServingOptions
from .schemas import (MAX_N, BOT_TASKS, COT_TASKS, ChatCompletionRequest, ErrorResponse, ImageEditRequest,
                      ImageGenerationRequest, ImagesResponse)
from .validation import MAX_ASPECT, MIN_SIDE

ERRORS = {400: "bad input, naming the field (``param``)", 401: "missing or wrong API key",
          404: "unknown model", 413: "body past its byte limit", 415: "body not JSON (multipart for edits)",
          429: "queue full (Retry-After)", 499: "client closed the connection (nobody reads it)",
          500: "failure inside the pipeline (request id in the log)", 503: "not ready or shutting down (Retry-After)",
          504: "past serving.request_timeout_s"}
POSTS = {"/v1/images/generations": (ImageGenerationRequest, "application/json", ImagesResponse),
         "/v1/images/edits": (ImageEditRequest, "multipart/form-data", ImagesResponse),
         "/v1/chat/completions": (ChatCompletionRequest, "application/json", None)}
# at least one non-space character: validation.is_blank's rule. Anchored, though the class alone says the same:
# schemathesis 4.32.5 folds minLength / maxLength into an unanchored pattern as ^\S{1,8000}$ (every character
# non-space), and then judged a form's "system_prompt: a b" invalid; an anchored pattern keeps its meaning through
# that rewrite. The class names the whitespace that only one engine's \s has (\x1c-\x1f, \x85: Python's re, which
# jsonschema and schemathesis use; \ufeff: ECMA-262, what JSON Schema patterns are, a JS client's validator), so
# that it means the same under both: neither's whitespace (tests/serving/test_blank_text.py)
NON_BLANK = r"^[\s\S]*[^\s\x1c-\x1f\x85\ufeff][\s\S]*$"
IMAGE_URI_FORMAT = "image-uri"  # a custom string format: the URL of one image by image_input's rules
IMAGE_MEDIA_TYPES = tuple(f"image/{f.lower()}" for f in FORMATS)  # image_input's formats: image/png, ...
GETS = {"/health": (200, 503), "/metrics": (200, 401), "/v1/models": (200, 401),
        "/v1/models/{model_id}": (200, 401, 404)}


def install_openapi(app: FastAPI, options: ServingOptions) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build(app, options)
        return app.openapi_schema

    app.openapi = openapi


def build(app: FastAPI, opt: ServingOptions) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-style images API of omni-run (docs/api.md)")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (ErrorResponse, ImagesResponse):
        _add_model(components, model)
    if opt.api_key is not None:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            _document(op, path, method, opt, components)
    return doc


def _document(op: dict, path: str, method: str, opt: ServingOptions, components: dict) -> None:
    secured = opt.api_key is not None and path != "/health"
    if secured:
        op["security"] = [{"bearer": []}]
    if method == "post" and path in POSTS:
        statuses = _document_post(op, path, opt, components) + ([401] if secured else [])
    else:
        statuses = [s for s in GETS.get(path, (200,)) if s != 200 and (s != 401 or secured)]
        if path == "/metrics":
            op["responses"] = {"200": {"description": "Prometheus text exposition",
                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}
        op["responses"].pop("422", None)  # the path parameter is any string: nothing answers 422
    for status in sorted(statuses):
        op["responses"][str(status)] = _error(status)


def _document_post(op: dict, path: str, opt: ServingOptions, components: dict) -> list[int]:
    """The request body and the 200 of a generating endpoint; returns its error statuses."""
    model, media, answer = POSTS[path]
    schema = _request_schema(model, opt, components)
    body = {"schema": schema}
    if media == "multipart/form-data":
        _form_fields(schema)
        body["encoding"] = _image_part(schema, opt)
    op["requestBody"] = {"required": True, "content": {media: body}}
    ok = {"$ref": f"#/components/schemas/{answer.__name__}"} if answer else {"type": "object"}
    op["responses"] = {"200": _json("the answer", ok)}
    return [400, 404, 413, 415, 429, 499, 500, 503, 504]


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(status: int) -> dict:
    answer = _json(ERRORS[status], {"$ref": "#/components/schemas/ErrorResponse"})
    if status == 499:
        return {"description": ERRORS[status]}
    if status in (429, 503):
        answer["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
    return answer


def _add_model(components: dict, model) -> None:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema


def _request_schema(model, opt: ServingOptions, components: dict) -> dict:
    """``model``'s JSON schema with this deployment's rules; its nested models go to ``components``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    props = schema["properties"]
    _text_rules(props, opt)
    _size_rules(props, opt)
    _count_rules(props, opt)
    _model_rules(props, opt)
    _refused(props, model, opt)
    _cot_rules(schema, opt)
    return schema


def _text_rules(props: dict, opt: ServingOptions) -> None:
    """Texts with at least one non-space character, up to serving's max_prompt_chars."""
    text = {"type": "string", "minLength": 1, "maxLength": opt.max_prompt_chars, "pattern": NON_BLANK}
    if "prompt" in props:
        props["prompt"] = {**text, "description": "what to draw (at least one non-space character)"}
    for name in ("negative_prompt", "system_prompt"):
        props[name] = _nullable(text, props[name].get("description"))


def _size_rules(props: dict, opt: ServingOptions) -> None:
    rule = f"; each side {MIN_SIDE}..{opt.max_side}, aspect ratio at most {MAX_ASPECT:g}:1"
    props["size"] = _nullable({"type": "string", "pattern": size_pattern(opt.max_side)},
                              props["size"].get("description", "") + rule)
    for name in ("height", "width"):
        if name in props:
            props[name] = _nullable({"type": "integer", "minimum": MIN_SIDE, "maximum": opt.max_side},
                                    "one alone means a square" + rule)


def _count_rules(props: dict, opt: ServingOptions) -> None:
    """n (and the chat's num_outputs_per_prompt) against the queue; steps against the deployment's cap."""
    queue = MAX_N if opt.max_queue is None else min(MAX_N, opt.max_queue)
    props["n"] = {"type": "integer", "minimum": 1, "maximum": queue, "default": 1}
    if "num_outputs_per_prompt" in props:
        props["num_outputs_per_prompt"] = _nullable({"type": "integer", "minimum": 1, "maximum": queue}, "n")
    props["num_inference_steps"] = _nullable({"type": "integer", "minimum": 1, "maximum": opt.max_steps},
                                             "denoising steps")


def _model_rules(props: dict, opt: ServingOptions) -> None:
    """What the model itself allows: the bot tasks (and CoT fields) of a model that writes text."""
    tasks = BOT_TASKS if opt.helpers.writes_text else ("image",)
    props["bot_task"] = _nullable({"type": "string", "enum": list(tasks)}, props["bot_task"].get("description"))
    if not opt.helpers.writes_text:
        props["drop_think"] = _nullable({"type": "boolean", "enum": [False]}, "only with a think bot_task")
        props["cot_max_tokens"] = {"type": "null", "description": "only with a bot_task that writes a CoT"}
        return
    cap = opt.max_cot_tokens
    budget = f"default {COT_BUDGET}, the official budget" if cap >= COT_BUDGET else f"default {cap}, the cap"
    props["cot_max_tokens"] = _nullable({"type": "integer", "minimum": 1, "maximum": cap},
                                        f"tokens the CoT may take ({budget})")


def _cot_rules(schema: dict, opt: ServingOptions) -> None:
    """The CoT fields' pairings, which the server holds by name (a 400): ``cot_max_tokens`` only with a task that
    writes a CoT, ``drop_think: true`` only with a think task (JSON Schema's if / then)."""
    if "cot_max_tokens" not in schema["properties"] or not opt.helpers.writes_text:
        return
    needs = [("cot_max_tokens", {"type": "integer"}, COT_TASKS),
             ("drop_think", {"const": True}, tuple(t for t in COT_TASKS if "think" in t))]
    schema["allOf"] = [{"if": {"required": [field], "properties": {field: given}},
                        "then": {"required": ["bot_task"], "properties": {"bot_task": {"enum": list(tasks)}}}}
                       for field, given, tasks in needs]


def _form_fields(schema: dict) -> None:
    """A multipart form has no null: an optional field is left out, so each field's null alternative goes (the
    form would carry the text "null", which no number or boolean field parses). An empty optional field is read
    as left out (edit_form.py: ``-F size=``), so each takes "" too."""
    props = schema["properties"]
    for name, field in list(props.items()):
        kept = [s for s in field.get("anyOf", ()) if s.get("type") != "null"]
        if field.get("type") == "null":
            del props[name]
            continue
        if len(kept) == 1 and len(field["anyOf"]) == 2:
            field = {**kept[0], **{k: v for k, v in field.items() if k not in ("anyOf", "default")}}
        if name not in schema.get("required", ()) and not _admits_empty(field):
            notes = {k: v for k, v in field.items() if k in ("description", "title", "default")}
            rule = {k: v for k, v in field.items() if k not in notes}
            said = notes.get("description")
            field = {"anyOf": [rule, {"const": ""}], **notes,
                     "description": f"{said}; empty: as if absent" if said else "empty: as if absent"}
        props[name] = field


def _admits_empty(field: dict) -> bool:
    """Whether ``field`` takes the empty string as it is (a string with no rule but its type)."""
    return field.get("type") == "string" and not {"enum", "const", "pattern", "minLength", "format"} & set(field)


def _image_part(schema: dict, opt: ServingOptions) -> dict:
    """The edit form's reference images, file parts that the pydantic model leaves out (edit_form.py reads the
    files apart): required, since the server refuses a form without one. Where the model takes several
    (``max_images`` > 1) the property is an array of 1..max_images files: in an OpenAPI 3.1 multipart body an
    array is sent as repeated parts of its name, so one file is the 1-item array, on the wire the same as a
    single ``image`` part (an ``anyOf`` of a file and the array would say the same to a validator, but
    schemathesis 4.32.5 sends a property whose schema is neither a file nor an array of files as parts without a
    filename, which a server reads as text fields). JSON Schema cannot say what the bytes must be, nor the
    other spellings the server takes: that goes in the description. Returns the form's ``encoding``, which
    names the parts' media types (of each item, for the array)."""
    n = opt.helpers.max_images
    file = {"type": "string", "contentMediaType": "application/octet-stream"}  # OpenAPI 3.1's spelling of a file
    count = ("one file, as ``image``" if n <= 1 else
             f"1 to {n} files, in upload order: repeated ``image`` parts (one is a single file), or repeated "
             "``image[]`` parts (the OpenAI SDK's spelling; ``image[0]``, ``image[1]``, ... work too); a file "
             f"past the {n}th is a 400 naming it (``image[{n}]``)")
    rules = f"Each {_image_rules(opt)} (the bytes decide the format, not the part's content type)"
    if n <= 1:
        image = {**file, "description": f"the reference image, {count}. {rules}"}
    else:
        image = {"type": "array", "items": file, "minItems": 1, "maxItems": n,
                 "description": f"the reference images, {count}. {rules}"}
    schema["properties"]["image"] = image
    schema["required"] = ["image", *schema.get("required", ())]
    return {"image": {"contentType": ", ".join(IMAGE_MEDIA_TYPES)}}


def _image_rules(opt: ServingOptions) -> str:
    """What image_input.py holds a reference image to, in words (JSON Schema cannot say it of bytes)."""
    return (f"must decode whole as {', '.join(FORMATS)}, in an 8-bit mode (16-bit, 32-bit and float images are "
            f"refused), each side at least {IMAGE_MIN_SIDE} px, at most {opt.max_image_pixels} pixels, aspect ratio "
            f"at most {IMAGE_MAX_ASPECT:g}:1, at most {opt.max_image_bytes} bytes (413 past it); alpha is "
            "composited onto white")


def _refused(props: dict, model, opt: ServingOptions) -> None:
    """Values the server refuses by name (a 400), so that the schema does not offer them."""
    if "response_format" in props:
        props["response_format"] = _nullable({"type": "string", "enum": ["b64_json"]}, "b64_json only")
        props["background"] = _nullable({"type": "string", "enum": ["auto", "opaque"]}, "no transparency")
    props["stream"] = _nullable({"type": "boolean", "enum": [False]}, "images are not streamed")
    if model is ChatCompletionRequest:
        props["messages"] = _messages(opt)
        props["modalities"] = _nullable({"type": "array", "maxItems": 1, "items": {"enum": ["image"]}},
                                        "['image'] (or absent)")


def _messages(opt: ServingOptions) -> dict:
    """Chat messages: text parts (on a model that edits, user messages also take image_url parts, at most
    ``max_images`` of them in all), and at least one user message with text, which is the prompt."""
    text = {"type": "string", "maxLength": opt.max_prompt_chars}
    said = {**text, "pattern": NON_BLANK}
    text_part = {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}, "text": text}}
    user_text = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "user"},
        "content": {"anyOf": [said, {"type": "array", "contains": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": said}}}]}}}
    messages = {"type": "array", "minItems": 1, "items": _message({"type": "string"}, [text_part], text),
                "contains": user_text,
                "description": "the user messages' text (joined) is the prompt; system / developer text the system "
                               "prompt"}
    n = opt.helpers.max_images
    if n:
        messages["items"] = {"anyOf": [_message({"const": "user"}, [text_part, _image_url_part(opt)], text),
                                       _message({"type": "string", "not": {"const": "user"}}, [text_part], text)]}
        messages["allOf"] = [_at_most_images(n)]
        messages["description"] += (f"; the image_url parts of user messages (only theirs), at most {n} in all, "
                                     "are the reference images, in order")
    return messages


def _message(role: dict, parts: list[dict], text: dict) -> dict:
    content = {"anyOf": [text, {"type": "array", "items": {"anyOf": parts}}, {"type": "null"}]}
    return {"type": "object", "required": ["role"], "properties": {"role": role, "content": content}}


def _image_url_part(opt: ServingOptions) -> dict:
    """A user message's reference image: ``image_url`` is its URL, or an object with it as ``url``. A data URI
    (an http(s) URL where this server fetches them) whose bytes must be one image by the edit form's rules, which
    the description states; its format, IMAGE_URI_FORMAT, names that for a fuzzer (tests/serving/fuzz_hooks.py
    draws real images for it)."""
    schemes = "[dD][aA][tT][aA]:[^,]*," + ("|[hH][tT][tT][pP][sS]?:" if opt.fetch_remote_images else "")
    where = ("a data URI (data:<media type>;base64,<data>) or an http(s) URL, which the server fetches"
             if opt.fetch_remote_images else "a data URI (data:<media type>;base64,<data>; remote URLs are not "
                                             "fetched by this server)")
    url = {"type": "string", "format": IMAGE_URI_FORMAT, "pattern": f"^({schemes})",
           "description": f"{where} of one image: {_image_rules(opt)}"}
    return {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"const": "image_url"},
        "image_url": {"anyOf": [url, {"type": "object", "required": ["url"], "properties": {"url": url}}]}}}


def _at_most_images(n: int) -> dict:
    """At most ``n`` image_url parts over all the messages, in JSON Schema: with c_k the number of messages
    holding at least k of them, the total is c_1 + c_2 + ..., so it is at most n exactly when (c_1, c_2, ...)
    stays under some partition of n (its parts in decreasing order) - one anyOf branch per partition."""
    def holding(k: int) -> dict:
        return {"type": "object", "required": ["content"], "properties": {"content": {
            "type": "array", "contains": {"type": "object", "required": ["type"],
                                          "properties": {"type": {"const": "image_url"}}}, "minContains": k}}}

    return {"anyOf": [{"allOf": [{"contains": holding(k), "minContains": 0, "maxContains": c}
                                 for k, c in enumerate((*parts, 0), 1)]}  # and none holding len(parts) + 1
                      for parts in _partitions(n)]}


def _partitions(n: int, largest: int | None = None) -> list[tuple[int, ...]]:
    """The partitions of ``n``, each in decreasing order (parts at most ``largest``)."""
    if n == 0:
        return [()]
    largest = n if largest is None else largest
    return [(first, *rest) for first in range(min(n, largest), 0, -1) for rest in _partitions(n - first, first)]


def _nullable(schema: dict, description: str | None) -> dict:
    out = {"anyOf": [schema, {"type": "null"}], "default": None}
    return {**out, "description": description} if description else out


def size_pattern(max_side: int) -> str:
    """``auto``, ``native`` or ``WxH`` with each side an integer in MIN_SIDE..max_side (no leading zero)."""
    side = "|".join(int_range_regex(MIN_SIDE, max_side))
    return f"^(auto|native|({side})[xX]({side}))$"


def int_range_regex(lo: int, hi: int) -> list[str]:
    """Regex alternatives matching exactly the decimal integers lo..hi (no sign, no leading zero)."""
    parts = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (digits - 1)), min(hi, 10 ** digits - 1)
        if a <= b:
            parts += _same_length(str(a), str(b))
    return parts


def _same_length(a: str, b: str) -> list[str]:
    if a == b:
        return [a]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + p for p in _same_length(a[1:], b[1:])]
    rest = len(a) - 1
    parts = [a[0] + p for p in _same_length(a[1:], "9" * rest)]
    if int(a[0]) + 1 <= int(b[0]) - 1:
        parts.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + "[0-9]" * rest)
    return parts + [b[0] + p for p in _same_length("0" * rest, b[1:])]
