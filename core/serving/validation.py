"""From a parsed body to checked ``ImageRequest``s: body limits, deployment limits, sizes, chat prompts.

Reading and parsing a body (bytes, content type, depth, Unicode, strict
types) is json_body.py. Static limits live in limits.py (schemas.py declares them on the fields); the limits here
depend on the deployment (the model, its sizes, the queue, prompt length, how
many reference images it takes). Every violation is an ``APIError`` 400 (404
for an unknown model, 413 for a body past its limit) naming the field.

Sizes follow the size contract (``SizePlan``): the model generates at its
snap of the request (``native``), the client gets exactly what it asked for
(``output``; None: the native size, for "native" / "auto").

Body limits: a JSON body without images is at most ``MAX_BODY_BYTES``; a
chat body may also carry ``max_images`` base64 data URIs of
``max_image_bytes`` each, an edit upload ``max_images`` files of
``max_image_bytes`` each (one more MiB for the other fields either way).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from omni.request import COT_BUDGET, ImageRequest

from .errors import APIError
from .image_input import ImageInputError, reference_size
from .options import ModelHelpers, ServingOptions
from .schemas import BOT_TASKS, COT_TASKS, GenerationParams

from .json_body import MAX_BODY_BYTES, parse_body, read_body, validated  # noqa: F401 (re-exported)
from .limits import MAX_ASPECT, MAX_SIDE, MIN_SIDE, NATIVE_SIZES, size_problem  # noqa: F401 (re-exported)

SIZE_TEXT = re.compile(r"[1-9][0-9]*[xX][1-9][0-9]*")  # what the OpenAPI size pattern allows (then the range)
# Blank text: every character whitespace for Python (str.isspace, re's \s) or for ECMA-262 (the \s of JSON Schema
# patterns: WhiteSpace, LineTerminator, category Zs). The two sets differ by \x1c-\x1f and \x85 (Python only) and
# \ufeff (ECMA only); the union is what the server refuses and what openapi.NON_BLANK excludes under either engine
BLANK = re.compile(r"[\s\ufeff]*")


def is_blank(text: str) -> bool:
    """Whether ``text`` has no character but whitespace (Python's or ECMA-262's): the empty string is blank."""
    return BLANK.fullmatch(text) is not None


@dataclass(frozen=True)
class SizePlan:
    """The (h, w) the model generates at, and the (h, w) the client gets (None: the native size, untouched)."""

    native: tuple[int, int]
    output: tuple[int, int] | None = None


def chat_body_limit(opt: ServingOptions) -> int:
    """Bytes a chat body may have: the JSON limit, plus room for the model's reference images as base64."""
    return MAX_BODY_BYTES + opt.helpers.max_images * 4 * -(-opt.max_image_bytes // 3)


def edit_body_limit(opt: ServingOptions) -> int:
    """Bytes an edit upload may have (room for one image even where the model takes none, to say so clearly)."""
    return MAX_BODY_BYTES + max(1, opt.helpers.max_images) * opt.max_image_bytes


def image_error(e: ImageInputError) -> APIError:
    """The answer to a refused reference image: 400 (413 for its bytes) naming the part."""
    return APIError(e.status, str(e), param=e.part, code="image_too_large" if e.status == 413 else "invalid_image")


@dataclass
class ChatInput:
    """What the chat messages ask for: the prompt, the system text, the reference images' URLs in order."""

    prompt: str
    system: str | None
    images: list[tuple[str, str]] = field(default_factory=list)  # (part name, url) of user image_url parts


def chat_input(messages) -> ChatInput:
    """The user text (all user messages joined), the system messages' text, the user messages' image URLs."""
    users, systems, images = [], [], []
    for i, m in enumerate(messages):
        texts = _message_parts(i, m, images)
        if m.role == "user":
            users += texts
        elif m.role in ("system", "developer"):
            systems += texts
    prompt = " ".join(t for t in users if t).strip()
    if is_blank(prompt):
        raise APIError(400, "messages: no user text to use as the prompt", param="messages")
    systems = [t for t in systems if not is_blank(t)]  # a blank system message says nothing: as if absent
    return ChatInput(prompt, "\n".join(systems) if systems else None, images)


def _message_parts(i: int, m, images: list[tuple[str, str]]) -> list[str]:
    """The message's texts; its image_url parts are appended to ``images`` (user messages only)."""
    texts = [m.content] if isinstance(m.content, str) else []
    for j, part in enumerate(m.content if isinstance(m.content, list) else []):
        name, kind = f"messages[{i}].content[{j}]", part.get("type")
        if kind == "text":
            texts.append(_part_text(name, part))
        elif kind == "image_url":
            images.append((name, _image_url(name, m.role, part)))
        else:
            raise APIError(400, f"{name}: part type {kind!r} is not supported; only 'text' and 'image_url' parts",
                           param=name)
    return texts


def _part_text(name: str, part: dict) -> str:
    text = part.get("text", "")
    if not isinstance(text, str):
        raise APIError(400, f"{name}.text: expected a string, got {type(text).__name__}", param=f"{name}.text")
    return text


def _image_url(name: str, role: str, part: dict) -> str:
    if role != "user":
        raise APIError(400, f"{name}: image_url parts are taken from user messages only, not {role!r} ones",
                       param=name)
    given = part.get("image_url")
    url = given.get("url") if isinstance(given, dict) else given
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{name}: expected {{'type': 'image_url', 'image_url': {{'url': "
                            "'data:image/png;base64,...'}}}", param=name)
    return url


class RequestBuilder:
    """Checks a parsed body against this deployment and turns it into the engine's requests."""

    def __init__(self, options: ServingOptions, helpers: ModelHelpers):
        self.opt, self.helpers = options, helpers

    def check_model(self, model: str | None) -> None:
        if model not in (None, "", self.opt.model_id):
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.opt.model_id!r}",
                           param="model", code="model_not_found")

    def size(self, size: str | None, field: str) -> SizePlan:
        """What a "WxH" size asks for: the model's nearest native size, then exactly WxH.

        None: the recipe's default size, exactly; "auto" / "native": the model's size for the default, untouched.
        """
        untouched = size in NATIVE_SIZES
        if size is None or untouched:
            size = self.opt.defaults.size
        if not SIZE_TEXT.fullmatch(size):
            raise APIError(400, f"{field}: expected WIDTHxHEIGHT (e.g. 1024x768), auto or native; got {size[:32]!r}",
                           param=field)
        try:
            h, w = self.helpers.parse_size(size)
        except ValueError as e:
            raise APIError(400, f"{field}: {e}", param=field) from None
        plan = self.sides(h, w, field)
        return SizePlan(plan.native) if untouched else plan

    def sides(self, h: int, w: int, field: str) -> SizePlan:
        problem = size_problem(h, w, self.opt.max_side)
        if problem:
            raise APIError(400, f"{field}: {problem}", param=field)
        return SizePlan(self.helpers.snap(h, w), (h, w))

    def edit_size(self, size: str | None, field: str, images: tuple) -> SizePlan:
        """An explicit size as ``size`` does; none follows the first reference image exactly ("auto" /
        "native": the model's snap of it, untouched).

        That snap is taken as the model gives it: the side range here bounds what clients ask for, and a
        model's own rule may go below it (the 256-base tiny Instruct table does).
        """
        if (size is not None and size not in NATIVE_SIZES) or not images:
            return self.size(size, field)
        native = reference_size(self.helpers, images[0])
        return SizePlan(native, None if size in NATIVE_SIZES else tuple(images[0].shape[:2]))

    def requests(self, rid: str, p: GenerationParams, prompt: str, n: int, plan: SizePlan,
                 system_prompt: str | None, images: tuple = (), auto_size: bool = False) -> list[ImageRequest]:
        """``n`` requests ``{rid}-{i}``; image i gets seed + i so that one call's images differ.

        ``images`` (decoded reference images, checked by image_input) are shared by all ``n``: each
        output is an edit of the same inputs. ``auto_size`` (size "auto" with a CoT bot_task): the
        model picks the aspect ratio after its CoT, and ``plan.native`` only bounds the pages it is priced at.
        """
        d, (h, w) = self.opt.defaults, plan.native
        self.check_text(prompt, "prompt", required=True)
        self.check_text(p.negative_prompt, "negative_prompt")
        bot_task = self._bot_task(p)
        self.check_n(n)
        system = self.system_prompt(system_prompt, bot_task)
        steps = p.num_inference_steps or d.steps
        if steps > self.opt.max_steps:
            raise APIError(400, f"num_inference_steps {steps} is above this server's limit of {self.opt.max_steps}",
                           param="num_inference_steps")
        guidance = d.guidance if p.guidance_scale is None else p.guidance_scale
        cot = self._cot_budget(p.cot_max_tokens)
        return [ImageRequest(prompt=prompt, negative_prompt=p.negative_prompt, height=h, width=w, steps=steps,
                             guidance=guidance, seed=None if p.seed is None else p.seed + i, shift=d.shift,
                             template=d.template, system_prompt=system, step_cache=p.step_cache,
                             images=tuple(images), request_id=f"{rid}-{i}", bot_task=bot_task,
                             drop_think=bool(p.drop_think), auto_size=auto_size and bot_task in COT_TASKS, **cot)
                for i in range(n)]

    def system_prompt(self, given: str | None, bot_task: str) -> str | None:
        """The system prompt text: the request's (a mode name or the text), else the recipe's, resolved for
        ``bot_task`` (``dynamic`` picks per task, as the official mapping does)."""
        value = given if given is not None else self.opt.defaults.system_prompt
        system = self.helpers.system_prompt(value, bot_task=bot_task)
        self.check_text(system, "system_prompt")
        return system

    def _bot_task(self, p: GenerationParams) -> str:
        """The bot task; a CoT task (and the CoT fields) only on a model that writes text."""
        bot_task = "image" if p.bot_task is None else p.bot_task  # "" is not a task (nor the default)
        if bot_task not in BOT_TASKS:
            raise APIError(400, f"bot_task {bot_task!r} is unknown; allowed: {', '.join(BOT_TASKS)}",
                           param="bot_task")
        if bot_task != "image" and not self.helpers.writes_text:
            raise APIError(400, f"bot_task {bot_task!r} needs a model that writes text (an Instruct flavour); "
                                f"model {self.opt.model_id} draws directly: use bot_task 'image'",
                           param="bot_task", code="unsupported_value")
        if p.drop_think and bot_task not in ("think", "think_recaption"):
            raise APIError(400, f"drop_think applies to bot_task think or think_recaption (a CoT with a <think> "
                                f"section), not {bot_task!r}", param="drop_think")
        if p.cot_max_tokens is not None and bot_task == "image":
            raise APIError(400, "cot_max_tokens applies to a bot_task that writes a CoT (recaption, think, "
                                "think_recaption), not 'image'", param="cot_max_tokens")
        return bot_task

    def _cot_budget(self, asked: int | None) -> dict:
        """``cot_max_tokens`` held to this server's cap (a 400 above it); a request that gives none keeps the
        official budget, or the cap where that is lower."""
        cap = self.opt.max_cot_tokens
        if asked is not None and asked > cap:
            raise APIError(400, f"cot_max_tokens {asked} is above this server's limit of {cap}",
                           param="cot_max_tokens")
        return {"cot_max_tokens": min(COT_BUDGET if asked is None else asked, cap)}

    def check_n(self, n: int, field: str = "n") -> None:
        if self.opt.max_queue is not None and n > self.opt.max_queue:
            raise APIError(400, f"{field}={n} can never be queued here: at most {self.opt.max_queue} requests are "
                                "accepted at once", param=field)

    def chat_count(self, body) -> int:
        """How many outputs a chat asks for: ``num_outputs_per_prompt`` where given, else ``n``; each field given
        is held to the queue on its own (the OpenAPI document caps both), so an ignored ``n`` is refused too."""
        self.check_n(body.n)
        if body.num_outputs_per_prompt is None:
            return body.n
        self.check_n(body.num_outputs_per_prompt, "num_outputs_per_prompt")
        return body.num_outputs_per_prompt

    def check_text(self, text: str | None, field: str, required: bool = False) -> None:
        if text is None and not required:
            return
        if text is None or is_blank(text):
            raise APIError(400, f"{field} must not be empty", param=field)
        if len(text) > self.opt.max_prompt_chars:
            raise APIError(400, f"{field} is {len(text)} characters; the limit is {self.opt.max_prompt_chars}",
                           param=field)
