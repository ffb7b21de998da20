"""The ``omni-run`` argument parser: commands, option groups, examples (``omni.cli`` runs them)."""
import argparse
from importlib.metadata import PackageNotFoundError, version

DEFAULT_RECIPE = "cpu_tiny"
LOG_LEVELS = ("debug", "info", "warning", "error")

EPILOG = """\
examples:
  omni-run platforms                         which platforms are installed, which are usable here
  omni-run models                            which model flavors are registered, which can be built
  omni-run recipes                           list and validate the packaged recipes
  omni-run recipes --platform cpu            ... and check each against the cpu platform
  omni-run recipes --check my.yaml           validate one recipe file (exit 2 with the reason if bad)
  omni-run recipes --schema                  every recipe key with allowed values and default
  omni-run recipes --docs                    regenerate docs/recipes/ (pages with memory estimates)
  omni-run generate --prompt "a red fox" -o fox.png
                                             one image with the embedded tiny model on the CPU
  omni-run generate --recipe h200_fp8 --model /ckpt/HunyuanImage-3 --prompt "a red fox" --trace
                                             the real model on one H200, logging each kernel choice
  omni-run edit --recipe cpu_tiny_instruct --image cat.png --prompt "make it snow" -o snow.png
                                             edit an image with an Instruct model (up to 3 --image)
  omni-run chat --recipe cpu_tiny_instruct --prompt "what is in this picture?" --image cat.png
                                             a text answer from an Instruct model, streamed to stdout
  omni-run generate --recipe cpu_tiny_instruct --bot-task think_recaption --size auto --prompt "a fox"
                                             the model thinks (CoT, printed to stderr) and picks the ratio
  omni-run --platform cuda --recipe h200_fp8 --model /ckpt/HunyuanImage-3
                                             serve (no command = serve) on 127.0.0.1:8091
  omni-run serve --host 0.0.0.0 --api-key "$KEY"
                                             serve the tiny model to the network, with a key
  omni-run bench --help                      the benchmark client's own options

A recipe is a packaged name (see `omni-run recipes`) or a path to a .yaml file.
--platform wins over detection; a recipe that names another platform is refused.
A recipe whose parallel degrees multiply to N runs N processes, for generate as for serve.

exit status: 0 ok, 1 runtime error, 2 usage or configuration error"""


def _common(parser: argparse.ArgumentParser, top: bool) -> None:
    """--log-level/--trace on the top parser and every command (SUPPRESS keeps the top value)."""
    default = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    g = parser.add_argument_group("logging")
    g.add_argument("--log-level", choices=LOG_LEVELS, default=default("info"), help="default: info")
    g.add_argument("--trace", action="store_true", default=default(False),
                   help="log which platform plugin answered each kernel spec (and who declined)")


def _deployment(parser: argparse.ArgumentParser, top: bool) -> None:
    default = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    g = parser.add_argument_group("deployment")
    g.add_argument("--recipe", metavar="NAME|FILE", default=default(DEFAULT_RECIPE),
                   help=f"packaged recipe name or .yaml path (default: {DEFAULT_RECIPE})")
    g.add_argument("--platform", metavar="NAME", default=default(None),
                   help="cpu, cuda, rocm, npu, xpu, musa, ... (default: the recipe's platform; auto = detect)")
    g.add_argument("--model", metavar="PATH", default=default(None),
                   help="Hugging Face-format model directory (overrides model.path)")
    # the command's own --set items add to those before the command (sub-level values of other flags replace)
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=default([]), dest="set" if top else "set_",
                   help="override one recipe key for this run, checked like the file (repeatable; omni-run "
                        "recipes --schema lists the keys), e.g. --set serving.max_running=2; --model, --host and "
                        "--port win over --set of the same key")


def _serving(parser: argparse.ArgumentParser, top: bool) -> None:
    default = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    g = parser.add_argument_group("serving")
    g.add_argument("--host", default=default(None), help="bind address (default: serving.host, 127.0.0.1)")
    g.add_argument("--port", type=int, default=default(None), help="TCP port (default: serving.port, 8091)")
    g.add_argument("--api-key", metavar="KEY", default=default(None),
                   help="require this key (prefer serving.api_key_env: command lines are visible to other users)")


EDIT_EPILOG = """\
examples:
  omni-run edit --recipe cpu_tiny_instruct --image cat.png --prompt "make it a watercolour painting" -o painted.png
                          the embedded tiny Instruct model on the CPU (random weights: coloured noise)
  omni-run edit --recipe h200_instruct_fp8 --model /ckpt/HunyuanImage-3.0-Instruct --image cat.png \\
      --image sofa.png --prompt "the cat of image 1 asleep on the sofa of image 2" --seed 3 --size 1024x768
                          the released Instruct model on one H200, two reference images

The images are read with the server's rules (docs/api.md): PNG, JPEG, WebP, GIF or BMP;
8-bit modes become RGB, alpha is composited onto white, 16-bit and float images are
refused; at most serving.max_image_pixels pixels, at least 16 px a side. Without --size
the output follows the first image's size, snapped to the model's sizes. The default
recipe (cpu_tiny, the base model) does not edit: a model that does not edit is refused
(exit 2). A bad image exits 2 naming its file."""


BOT_TASKS = ("image", "recaption", "think", "think_recaption")

GENERATE_EPILOG = """\
examples:
  omni-run generate --prompt "a red fox in snow" --seed 1 -o fox.png
  omni-run generate --recipe h200_fp8 --model /ckpt/HunyuanImage-3 --prompt "..." --size 1280x768 --steps 30
  omni-run generate --recipe cpu_tiny_instruct --prompt "a red fox in snow" --bot-task think_recaption \\
      --size auto --cot-max-tokens 64 -o fox.png
                          an Instruct model writes a CoT (think, then recaption; printed to stderr),
                          picks the aspect ratio itself (--size auto), then draws

--bot-task other than image needs an Instruct model (exit 2 otherwise)."""


def _image_flags(p: argparse.ArgumentParser, prompt_help: str, size_help: str) -> argparse._ArgumentGroup:
    """The flags generate and edit share (what to draw, how, where to write it, whether to think first)."""
    g = p.add_argument_group("image")
    g.add_argument("--prompt", required=True, help=prompt_help)
    g.add_argument("--negative-prompt", default=None,
                   help="text of the unconditional CFG row (default: the official <cfg>-token row)")
    g.add_argument("--size", metavar="WxH|native|auto",
                   help=size_help + "; the image has exactly this size (generated at the model's nearest native size, "
                                    "centre-cropped to the aspect, resampled); native: the model's size untouched; "
                                    "auto: the same, and with a CoT --bot-task the model picks the aspect ratio")
    g.add_argument("--steps", type=int, help="denoising steps, 1..200 (default: defaults.steps)")
    g.add_argument("--guidance", type=float, help="guidance scale, 0..30 (default: defaults.guidance)")
    g.add_argument("--seed", type=int, help="random seed (default: random)")
    g.add_argument("-o", "--output", default="out.png", metavar="IMAGE",
                   help="output image; its extension picks the format (.png, .jpg, .webp, ...; default: out.png); "
                   "checked before anything is generated")
    g.add_argument("--latents", metavar="FILE", help="also write the final latents as safetensors (parity checks)")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="also print the model's native size the image was generated at before the fit to --size")
    t = p.add_argument_group("think / recaption before drawing (Instruct models)")
    t.add_argument("--bot-task", choices=BOT_TASKS, default="image",
                   help="image: draw directly (default); recaption / think / think_recaption: write a CoT first "
                        "(printed to stderr), then draw from it")
    t.add_argument("--drop-think", action="store_true", help="leave the <think> section out of the image pass")
    t.add_argument("--cot-max-tokens", type=int, metavar="N", help="tokens the CoT may take (default 2048)")
    return g


CHAT_EPILOG = """\
examples:
  omni-run chat --recipe cpu_tiny_instruct --prompt "describe a red fox"
                          one answer, streamed to stdout as it is generated (the tiny model's
                          random weights answer gibberish tokens)
  omni-run chat --recipe h200_instruct_fp8 --model /ckpt/HunyuanImage-3.0-Instruct \\
      --image cat.png --prompt "what is the cat doing?" --max-tokens 200
                          the released Instruct model answering about an image
  printf 'hello\\nwhat is 2+2?\\n' | omni-run chat --recipe cpu_tiny_instruct
                          one answer per line of stdin

Without --prompt, chat reads prompts from stdin, one per line, until end of input
(Ctrl-D at a terminal). Every line is a fresh single-turn prompt: there is no history,
the model never sees earlier lines or answers. --image and the sampling flags apply to
every line. Sampling defaults are the Instruct generation_config (temperature 0.6,
top-k 1024, top-p 0.95); --temperature 0 is greedy. A model that does not write text
(the default recipe cpu_tiny, the base model) exits 2."""


def _chat_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("answer")
    g.add_argument("--prompt", help="what to answer (default: read prompts from stdin, one per line)")
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image the prompt is about (PNG, JPEG, WebP, GIF, BMP); repeat for up to 3")
    g.add_argument("--system-prompt", metavar="MODE|TEXT",
                   help="a system prompt mode (en_unified, en_vanilla, ...) or the text (default: the recipe's)")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="answer length limit (default: 256)")
    g.add_argument("--temperature", type=float, help="0 = greedy, else 1e-4..2 (default: 0.6)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass, 1e-6..1 (default: 0.95)")
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens, 0 = all (default: 1024)")
    g.add_argument("--seed", type=int, help="sampling seed, the same for every line (default: random)")


def _command(sub, name: str, help: str, epilog: str, **kwargs) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-run", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Serve HunyuanImage-3.0 on any accelerator. Without a command, omni-run serves.")
    parser.add_argument("--version", action="version", version=f"omni-run {_version()}")
    _common(parser, top=True)
    _deployment(parser, top=True)
    _serving(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _listing_commands(sub)
    _image_commands(sub)
    p = _command(sub, "chat", "answer in text with an Instruct model: one --prompt, or one prompt per stdin line "
                              "(each a fresh single-turn prompt, no history)", CHAT_EPILOG)
    _common(p, top=False)
    _deployment(p, top=False)
    _chat_flags(p)
    _serve_command(sub)
    _command(sub, "bench", "benchmark a running server (all arguments go to the benchmark client)",
             "example:\n  omni-run bench --help", add_help=False)
    return parser


def _listing_commands(sub) -> None:
    """platforms, models, recipes: what is installed, registered and valid here."""
    for name, what in (("platforms", "list installed platforms and whether each is usable here"),
                       ("models", "list the registered model flavors and whether each can be built")):
        _common(_command(sub, name, what, f"example:\n  omni-run {name}"), top=False)
    p = _command(sub, "recipes", "list and validate recipes",
                 "examples:\n  omni-run recipes\n  omni-run recipes --platform cuda\n"
                 "  omni-run recipes --check my.yaml\n  omni-run recipes --schema\n  omni-run recipes --docs")
    _common(p, top=False)
    p.add_argument("--platform", metavar="NAME", default=argparse.SUPPRESS,
                   help="also check recipes for this platform against it (others are listed as skipped)")
    p.add_argument("--check", metavar="FILE", help="validate one recipe file; prints 'ok: NAME' or the reason")
    p.add_argument("--schema", action="store_true", help="print every recipe key, its allowed values and default")
    p.add_argument("--docs", metavar="DIR", nargs="?", const="",
                   help="regenerate the recipe docs (default DIR: docs/recipes of this checkout)")


def _image_commands(sub) -> None:
    """generate and edit: one image each, in this process or on the recipe's ranks."""
    p = _command(sub, "generate", "generate one image", GENERATE_EPILOG)
    _common(p, top=False)
    _deployment(p, top=False)
    _image_flags(p, "what to draw", "image size (default: the recipe's defaults.size)")
    p = _command(sub, "edit", "edit images: a prompt plus 1 to 3 reference images (an Instruct model)",
                 EDIT_EPILOG)
    _common(p, top=False)
    _deployment(p, top=False)
    g = _image_flags(p, "what to change, e.g. 'make the sky stormy' or 'put the cat of image 1 on the sofa of "
                        "image 2'", "output size (default: the first image's size, snapped to the model's sizes)")
    g.add_argument("--image", action="append", required=True, metavar="FILE",
                   help="a reference image (PNG, JPEG, WebP, GIF, BMP); repeat for up to 3, in prompt order")


def _serve_command(sub) -> None:
    p = _command(sub, "serve", "serve the OpenAI-style images API (also: omni-run without a command)",
                 "examples:\n  omni-run serve\n  omni-run serve --platform npu --recipe a2_tp4 --model /ckpt/HI3 "
                 "--port 9000\n  omni-run --platform npu --recipe a2_tp4 --model /ckpt/HI3   (same, bare form)"
                 "\n  omni-run serve --ray --ray-address auto --recipe h200_fp8 --model /ckpt/HI3   "
                 "(Ray Serve replicas)")
    _common(p, top=False)
    _deployment(p, top=False)
    _serving(p, top=False)
    g = p.add_argument_group("scale-out (Ray Serve; docs/parallel.md)")
    g.add_argument("--ray", action="store_true", help="serve the replicas as Ray Serve deployments (recipe ray: "
                                                      "bounds), behind Ray's HTTP proxy on --host/--port")
    g.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to join: auto, or HOST:PORT of its head "
                                                         "(default: start a local one); needs --ray")


def _version() -> str:
    try:
        return version("omni-run")
    except PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------ commands
