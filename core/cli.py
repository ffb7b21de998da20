"""The ``omni-run`` command line.

Commands: ``platforms``, ``models``, ``recipes``, ``generate``, ``edit``, ``chat``,
``serve`` (also the bare form ``omni-run --platform X --recipe Y``) and ``bench``. Exit status: 0 ok,
1 runtime error, 2 usage or configuration error (bad recipe, unusable or
refusing platform), each printed as one ``omni-run: error: ...`` line.

For ``generate`` and ``serve`` the CLI turns its flags into frozen objects
and hands them over; it never passes the argparse Namespace on::

    omni.deployment.prepare(--recipe, --platform, overrides from --set, then --model/--host/--port)
        -> Deployment (checked, patched, platform and model flavour concrete)
    generate: GenerateJob (the ImageRequest with recipe defaults filled, the output path)
        -> omni.generate.generate_main(deployment, job)
    edit:     the same GenerateJob with the request's reference ``images`` filled (decoded and
              checked by omni.serving.image_input, the server's own rules) -> generate_main
    chat:     ChatJob (the prompt or stdin, images, system prompt, sampling) -> omni.chat.chat_main
    serve:    Endpoint (host, port, API key read from serving.api_key_env: the only
              environment read of the startup path) -> omni.serving.server.serve_main(deployment, endpoint)

Heavy modules (torch, the platform manager, the model, the server) are
imported only by the commands that need them, so ``--help`` and ``recipes
--check`` stay fast.
"""
import logging
import os
import sys
from pathlib import Path

from .deployment import DeploymentError, Endpoint, check_on
from .recipe import GiB, Recipe, RecipeError, list_recipes, load_recipe, parse_overrides, schema_rows
from .cli_jobs import (
    UsageError, check_generation_flags, check_range, generate_job, image_request, reference_images, serving_helpers,
)
from .cli_parser import build_parser

log = logging.getLogger("omni.cli")
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2

def cmd_platforms(args) -> int:
    from .platform_manager import detect_all

    rows, detections = [], detect_all()
    for d in detections:
        if d.info is None:
            rows.append((d.name, "no", "-", "; ".join(d.reasons) or "no reason given"))
            continue
        mem = f", {d.info.memory_bytes / GiB:.0f} GiB each" if d.info.memory_bytes else ""
        kind = "accelerator" if d.info.accelerator else "reference, not an accelerator"
        rows.append((d.name, "yes", f"{d.info.device_count} x {d.info.device_name or d.info.device_type}{mem}",
                     f"{kind}; torch.distributed backend {d.info.dist_backend}"))
    print(_table(("PLATFORM", "DETECTED", "DEVICES", "DETAILS"), rows))
    present = [d.name for d in detections if d.info is not None and d.info.accelerator]
    auto = present[0] if len(present) == 1 else ("none (use --platform cpu)" if not present else "ambiguous: "
                                                 + ", ".join(present) + " (choose with --platform)")
    print(f"\n--platform auto selects: {auto}")
    return EXIT_OK


def cmd_recipes(args) -> int:
    if args.schema:
        print(_table(("KEY", "ALLOWED", "DEFAULT", "MEANING"), schema_rows()))
        return EXIT_OK
    if args.docs is not None:
        return _write_docs(args.docs)
    name = getattr(args, "platform", None)
    platform, absent = _usable_platform(name, args.trace) if name else (None, "")
    if args.check:
        recipe = load_recipe(args.check)
        if name and recipe.platform not in ("auto", name):
            raise UsageError(f"recipe {recipe.name} is for platform {recipe.platform}, not {name}")
        if platform is not None:
            check_on(recipe, platform)
        print(f"ok: {recipe.name}" + (f" ({_not_checked(name, absent)})" if name and platform is None else ""))
        return EXIT_OK
    rows, status = [], EXIT_OK
    for recipe_name in list_recipes():  # every file is schema-validated, whatever the platform
        try:
            recipe = load_recipe(recipe_name)
            verdict = _verdict(recipe, name, platform, absent)
        except (RecipeError, UsageError, DeploymentError) as e:
            rows.append((recipe_name, "-", "-", f"error: {e}", ""))
            status = EXIT_USAGE
            continue
        rows.append((recipe.name, recipe.platform, f"{recipe.device.count} x {recipe.device.kind}", verdict,
                     recipe.description))
    print(_table(("RECIPE", "PLATFORM", "DEVICES", "STATUS", "DESCRIPTION"), rows))
    return status


def _detect_named(name: str, listed: str, more: str = ""):
    """(detection, its reasons joined) of the installed platform ``name``; UsageError listing the installed ones
    when there is none of that name."""
    from .platform_manager import detect, discover

    installed = discover()
    if name not in installed:
        raise UsageError(f"unknown platform {name!r}; {listed}: {', '.join(sorted(installed))}{more}")
    found = detect(name, installed[name])
    return found, "; ".join(found.reasons) or "no reason given"


def _usable_platform(name: str, trace: bool):
    """``(Platform, "")``, or ``(None, reason)`` when the platform is installed but not present here."""
    from .platform_manager import select

    found, reason = _detect_named(name, "installed")
    if found.info is None:
        print(f"note: platform {name} is not present here ({reason}); its recipes are validated against "
              f"the schema only -- run this on a machine with {name} to check them against the platform")
        return None, reason
    return select(name, trace=trace), ""


def _not_checked(name: str, reason: str) -> str:
    return f"not checked: platform {name} not present here ({reason})"


def _verdict(recipe: Recipe, name: str | None, platform, absent: str = "") -> str:
    if name is None:
        return "ok"
    if recipe.platform not in ("auto", name):
        return f"skipped (platform {recipe.platform})"
    if platform is None:
        return f"ok (schema); {_not_checked(name, absent)}"
    check_on(recipe, platform)
    return f"ok (checked on {name})"


def _write_docs(folder: str) -> int:
    from .recipe_docs import REPO_DOCS, write_docs

    if not folder and not REPO_DOCS.parent.is_dir():
        raise UsageError(f"no docs folder at {REPO_DOCS.parent} (not a source checkout); pass --docs DIR")
    out = Path(folder) if folder else REPO_DOCS
    print(f"wrote {len(write_docs(out))} pages to {out}")
    return EXIT_OK


def cmd_models(args) -> int:
    from . import model_registry

    rows = []
    for entry in model_registry.discover():
        if entry.flavor is None:
            rows.append((entry.name, "no", entry.error))
            continue
        missing = entry.flavor.unavailable()
        weights = "needs --model" if entry.flavor.needs_weights else "embedded weights"
        rows.append((entry.name, "no" if missing else "yes",
                     f"{entry.flavor.description} ({weights})" + (f"; {missing}" if missing else "")))
    print(_table(("FLAVOR", "USABLE", "DETAILS"), rows))
    print("\nmodel.flavor: auto reads the checkpoint's config.json and picks the flavor that claims it")
    return EXIT_OK


def _deployment(args, serving: bool):
    from .deployment import prepare

    overrides = parse_overrides(args.set + getattr(args, "set_", []))  # before COMMAND, then the command's own
    overrides |= {"model.path": args.model} if args.model else {}
    if serving:
        overrides |= {k: v for k, v in (("serving.host", args.host), ("serving.port", args.port)) if v is not None}
    _check_platform(args.platform or load_recipe(args.recipe).replace_paths(overrides).platform)
    return prepare(args.recipe, platform=args.platform, overrides=overrides, trace=args.trace)


def _check_platform(name: str) -> None:
    """An unknown platform named with the list; one not usable here reported first (before weights or the
    recipe's other requirements), with the extra that installs its software."""
    if name == "auto":
        return
    found, reason = _detect_named(name, "known", " (or auto)")
    if found.info is None:
        extra = (f"; its software installs with pip install 'omni-run[{name}]' (on a machine with its devices)"
                 if name in _extras() else "")
        raise UsageError(f"platform {name!r} is not usable here: {reason}{extra}")


def _extras() -> list[str]:
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        return metadata("omni-run").get_all("Provides-Extra") or []
    except PackageNotFoundError:
        return []


def cmd_generate(args) -> int:
    check_generation_flags(args)
    deployment = _deployment(args, serving=False)
    helpers = serving_helpers(deployment, args.bot_task != "image", "--bot-task " + args.bot_task)
    generate_main = _generate_main()
    d = deployment.recipe.defaults
    return generate_main(deployment, generate_job(args, image_request(args, d, helpers), d.size))


def cmd_edit(args) -> int:
    """generate, with the reference images read and checked as the server checks uploads."""
    check_generation_flags(args)
    deployment = _deployment(args, serving=False)
    helpers = serving_helpers(deployment, args.bot_task != "image", "--bot-task " + args.bot_task)
    images, size = reference_images(args.image, deployment.recipe)
    generate_main = _generate_main()
    d = deployment.recipe.defaults
    request = image_request(args, d, helpers, images=images, default_size=size)
    return generate_main(deployment, generate_job(args, request, d.size, images))


def cmd_chat(args) -> int:
    """Text answers: the flags checked, the images decoded (the server's rules), then omni.chat."""
    from .chat import ChatJob, chat_main
    from .serving.limits import MAX_TEMPERATURE, MAX_TEXT_TOKENS, MIN_TEMPERATURE, MIN_TOP_P

    check_range(args.max_tokens, "--max-tokens", 1 <= args.max_tokens <= MAX_TEXT_TOKENS, f"1..{MAX_TEXT_TOKENS}")
    t = args.temperature or 0
    check_range(args.temperature, "--temperature", t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE,
                 f"0 (greedy) or {MIN_TEMPERATURE:g}..{MAX_TEMPERATURE:g}")
    check_range(args.top_p, "--top-p", args.top_p is None or MIN_TOP_P <= args.top_p <= 1, f"{MIN_TOP_P:g}..1")
    check_range(args.top_k, "--top-k", (args.top_k or 0) >= 0, ">= 0")
    deployment = _deployment(args, serving=False)
    helpers = serving_helpers(deployment, True, "chat")
    images = reference_images(args.image, deployment.recipe)[0] if args.image else ()
    given = args.system_prompt if args.system_prompt is not None else deployment.recipe.defaults.system_prompt
    sampling = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                  ("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed)) if v is not None}
    job = ChatJob(args.prompt, images, helpers.system_prompt(given, bot_task="text"), sampling)
    return chat_main(deployment, job)


def _generate_main():
    try:
        from .generate import generate_main
    except ModuleNotFoundError as e:
        _missing(e, "omni.generate", "generate")
    return generate_main


def cmd_serve(args) -> int:
    deployment = _deployment(args, serving=True)
    serving = deployment.recipe.serving
    api_key = args.api_key
    if api_key is None and serving.api_key_env:
        api_key = os.environ.get(serving.api_key_env)
        if not api_key:
            raise UsageError(f"serving.api_key_env names {serving.api_key_env}, which is not set (export it, or "
                             "pass --api-key)")
    if serving.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach it can use it", serving.host)
    if getattr(args, "ray", False) or getattr(args, "ray_address", None):  # only the serve command has them
        return _serve_ray(args, deployment, Endpoint(serving.host, serving.port, api_key))
    try:
        from .serving.server import serve_main
    except ModuleNotFoundError as e:
        _missing(e, "omni.serving.server", "serve")
    return serve_main(deployment, Endpoint(serving.host, serving.port, api_key))


def _serve_ray(args, deployment, endpoint: Endpoint) -> int:
    if not args.ray:
        raise UsageError("--ray-address needs --ray")
    try:
        from .serving.ray_serve import serve_ray_main
    except ModuleNotFoundError as e:
        if e.name != "ray" and not (e.name or "").startswith("ray."):
            raise
        raise UsageError("--ray needs Ray Serve: pip install 'omni-run[ray]'") from None
    return serve_ray_main(deployment, endpoint, args.ray_address)


def cmd_bench(args) -> int:
    try:
        from .bench_client import bench_main
    except ModuleNotFoundError as e:
        _missing(e, "omni.bench_client", "bench")
    return bench_main(args.bench_args)


def _missing(error: ModuleNotFoundError, module: str, command: str):
    """Re-raise unless the command's own module is what is missing (not yet part of this build)."""
    if error.name is None or not (module == error.name or module.startswith(error.name + ".")):
        raise error
    raise RuntimeError(f"'{command}' is not available in this build ({module} is missing)") from None


COMMANDS = {"platforms": cmd_platforms, "models": cmd_models, "recipes": cmd_recipes, "generate": cmd_generate,
            "edit": cmd_edit, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench}


# ------------------------------------------------------------------ entry point


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    rows = [header, *[tuple(map(str, r)) for r in rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows)


def _setup_logging(args) -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("omni").setLevel(args.log_level.upper())
    if args.trace:
        logging.getLogger("omni.platforms").setLevel(logging.INFO)


def _exit_code(error: BaseException) -> int:
    config = (RecipeError, UsageError)  # each module below is looked at only if this run imported it
    config += (DeploymentError,)
    for module, name in (("omni.platform_manager", "PlatformError"), ("omni.model_registry", "ModelError")):
        if module in sys.modules:
            config += (getattr(sys.modules[module], name),)
    return EXIT_USAGE if isinstance(error, config) else EXIT_RUNTIME


def main(argv: list[str] | None = None) -> int:
    """Run omni-run with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:  # no command (argv empty too) serves, as the help says
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "bench":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse: --help/--version (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    args.bench_args = extra
    _setup_logging(args)
    try:
        code = COMMANDS[args.command or "serve"](args) or EXIT_OK
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler below
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `omni-run recipes --schema | head`: the reader left early; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush writes nowhere
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - every error becomes one line and an exit status
        code = _exit_code(e)
        log.debug("%s", e, exc_info=True)
        print(f"omni-run: error: {e if code == EXIT_USAGE else f'{type(e).__name__}: {e}'}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
