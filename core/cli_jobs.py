"""Turning the ``generate`` / ``edit`` / ``chat`` flags into requests: their checks (the API's bounds, each
refusal naming its flag), the reference images (read and checked by the server's rules) and the frozen
``ImageRequest`` / ``GenerateJob`` the commands hand on. A refusal is a ``UsageError`` (exit status 2)."""
from __future__ import annotations

import math
import os
from pathlib import Path

from .recipe import RecipeError, parse_size
from .request import GenerateJob, ImageRequest


class UsageError(Exception):
    """A problem with what the user asked for; exit status 2."""


def check_range(value, flag: str, ok: bool, allowed: str) -> None:
    if value is not None and not ok:
        raise UsageError(f"{flag} must be {allowed}, got {value}")


def serving_helpers(deployment, writes_text: bool, what: str):
    """The flavour's serving helpers; a model that does not write text refuses ``what`` (exit 2)."""
    flavor = deployment.recipe.model.flavor
    helpers = deployment.flavor().serving_helpers()
    if writes_text and not helpers.writes_text:
        raise UsageError(f"{what}: model {flavor} does not write text (it draws images only); use an Instruct "
                         "flavour (e.g. --recipe cpu_tiny_instruct)")
    return helpers


def check_generation_flags(args) -> None:
    """The API's bounds (omni.serving.schemas / validation), each refusal naming its flag."""
    from .serving.limits import MAX_TEXT_TOKENS

    _check_size_flag(args.size)
    _check_number_flags(args)
    _check_text_flags(args)
    if args.drop_think and args.bot_task not in ("think", "think_recaption"):
        raise UsageError("--drop-think applies to --bot-task think or think_recaption (a CoT with a <think> section)")
    cot = args.cot_max_tokens
    if cot is not None and (args.bot_task == "image" or not 1 <= cot <= MAX_TEXT_TOKENS):
        raise UsageError(f"--cot-max-tokens must be 1..{MAX_TEXT_TOKENS} and needs a --bot-task that writes a CoT "
                         "(recaption, think, think_recaption)")


def _check_size_flag(size: str | None) -> None:
    from .serving.limits import NATIVE_SIZES, size_problem

    if size is not None and size not in NATIVE_SIZES:
        width, height = _parse_size_arg(size)
        problem = size_problem(height, width)
        if problem:
            raise UsageError(f"--size: {problem}")


def _check_number_flags(args) -> None:
    """--steps, --guidance (finite: inf drew an all-black image) and --seed within the API's ranges."""
    from .serving.limits import MAX_GUIDANCE, MAX_SEED, MAX_STEPS

    steps, g, seed = args.steps, args.guidance, args.seed
    check_range(steps, "--steps", steps is not None and 1 <= steps <= MAX_STEPS, f"1..{MAX_STEPS}")
    check_range(g, "--guidance", g is not None and math.isfinite(g) and 0 <= g <= MAX_GUIDANCE,
                 f"a finite number in 0..{MAX_GUIDANCE:g}")
    check_range(seed, "--seed", seed is not None and 0 <= seed <= MAX_SEED, f"0..{MAX_SEED}")


def _check_text_flags(args) -> None:
    """Valid Unicode (a command line decoded with surrogateescape can hold lone surrogates)."""
    from .serving.errors import APIError
    from .serving.limits import check_unicode

    for flag, text in (("--prompt", args.prompt), ("--negative-prompt", args.negative_prompt)):
        try:
            check_unicode(text, flag)
        except APIError as e:  # its message names the flag
            raise UsageError(e.message) from None


def generate_job(args, request: ImageRequest, default: str, images: tuple = ()) -> GenerateJob:
    output = _image_output(Path(args.output))
    latents = _writable("--latents", Path(args.latents)) if args.latents else None
    return GenerateJob(request, output, latents, output_size=_output_size(args, default, images),
                       verbose=args.verbose)


def _image_output(path: Path) -> Path:
    """``-o`` checked before anything is generated: an image format Pillow writes, chosen by the extension,
    in a place this process can write (an image that cannot be saved is an image lost)."""
    from PIL import Image

    if path.is_dir():
        raise UsageError(f"-o/--output {path}: is a directory; name the image file (e.g. {path / 'out.png'})")
    Image.init()
    known = Image.registered_extensions()
    if known.get(path.suffix.lower()) not in Image.SAVE:
        writable = sorted(ext for ext, fmt in known.items() if fmt in Image.SAVE and ext in _COMMON_IMAGES)
        raise UsageError(f"-o/--output {path}: the extension picks the image format; use one of "
                         f"{', '.join(writable)}")
    return _writable("-o/--output", path)


_COMMON_IMAGES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")


def _writable(flag: str, path: Path) -> Path:
    """``path`` once its directory exists and a file can be created there (created and removed again where it did
    not exist, appended nothing where it did); a UsageError naming ``flag`` otherwise. Something there that is not
    a regular file (a FIFO, a device) is asked for write permission only: opening a FIFO waits for a reader."""
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "it is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not path.is_file():
            if not os.access(path, os.W_OK):
                raise PermissionError(13, "Permission denied")
            return path
        existed = path.exists()
        with open(path, "ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return path


def _output_size(args, default: str, images: tuple) -> tuple[int, int] | None:
    """(h, w) the written image has: --size exactly, else an edit's first image, else defaults.size;
    --size auto / native: the model's own size, untouched."""
    from .serving.limits import NATIVE_SIZES

    if args.size in NATIVE_SIZES:
        return None
    if args.size is None and images:
        return tuple(images[0].shape[:2])
    width, height = _parse_size_arg(args.size or default)
    return height, width


def reference_images(paths: list[str], recipe) -> tuple[tuple, tuple[int, int]]:
    """The decoded ``--image`` files and the (width, height) the first one asks for (snapped by the model).

    The rules are the server's (omni.serving.image_input); any refusal names the file and exits 2.
    """
    from . import model_registry
    from .serving.image_input import ImageInputError, ImageRules, decode_images, reference_size

    helpers = model_registry.get(recipe.model.flavor).serving_helpers()
    rules = ImageRules(recipe.model.flavor, helpers.max_images, recipe.serving.max_image_pixels)
    try:
        images = decode_images([(f"--image {p}", _read_file(p)) for p in paths], rules)
    except ImageInputError as e:
        hint = " (e.g. --recipe cpu_tiny_instruct)" if helpers.max_images == 0 else ""
        raise UsageError(f"{e}{hint}") from None
    height, width = reference_size(helpers, images[0])
    return images, (width, height)


def _read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"--image {path}: cannot read it: {e.strerror or e}") from None


def image_request(args, d, helpers, images: tuple = (), default_size: tuple[int, int] | None = None):
    """The flags, with the recipe's ``defaults`` where a flag is not given (an edit's size: its first image's).

    ``--size auto``: with a CoT ``--bot-task`` the model picks the ratio (``auto_size``); without one it is the
    default size, as over the API. The recipe's system prompt mode is resolved for the bot task.
    """
    size = None if args.size in ("auto", "native") else args.size
    if size is not None or default_size is None:
        width, height = _parse_size_arg(size or d.size)
    else:
        width, height = default_size
    cot = {"cot_max_tokens": args.cot_max_tokens} if args.cot_max_tokens is not None else {}
    return ImageRequest(prompt=args.prompt, negative_prompt=args.negative_prompt, height=height, width=width,
                        steps=d.steps if args.steps is None else args.steps,
                        guidance=d.guidance if args.guidance is None else args.guidance, seed=args.seed,
                        shift=d.shift, template=d.template,
                        system_prompt=helpers.system_prompt(d.system_prompt, bot_task=args.bot_task),
                        return_latents=args.latents is not None, images=images, bot_task=args.bot_task,
                        drop_think=args.drop_think, auto_size=args.size == "auto" and args.bot_task != "image", **cot)


def _parse_size_arg(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except RecipeError as e:
        raise UsageError(f"--size: {e}") from None
