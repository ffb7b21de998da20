"""What a fresh server pays the first time it meets a prompt length: JIT compiles in the prefill and the step.

A serving process starts with an empty Triton cache (a new container) or a
warm one (a restart on the same disk). Triton compiles a kernel variant per
new specialization of its arguments, so the first request of each new
prompt length may wait for compiles that later requests do not. This builds
a recipe's pipeline as ``omni-run bench --full-size-layers`` does (random
weights, released widths), points Triton at an empty cache directory, and
runs requests whose prompts differ in length one after another, reporting
per request: prompt tokens per row, prefill and first/second step seconds,
and how many kernel binaries Triton compiled meanwhile.

    python bench/profile_first_use.py --recipe h200_fp8 --layers 8 --json out.json
    python bench/profile_first_use.py --recipe h200_fp8 --layers 8 --warm-up --json out.json   # as a server starts
    python bench/profile_first_use.py --recipe h200_instruct_fp8 --layers 32 --warm-up image --answers 16 --words 3
    python bench/profile_first_use.py --recipe h200_instruct_fp8 --warm-up --batches 2,8,17,64 --words 3
    python bench/profile_first_use.py --recipe h200_fp8 --layers 32 --warm-up --compile-first   # the compile pass
    python bench/profile_first_use.py --recipe h200_instruct_fp8 --warm-up --words 3 --sizes 576x1472,512x1984
    python bench/profile_first_use.py --recipe h200_instruct_fp8 --layers 32 --warm-up --words 3 --edits 2
    python bench/profile_first_use.py --recipe h200_fp8 --layers 32 --warm-up job [--compile-first] --words 3

``--warm-up job`` starts as ``omni-run generate`` does: no warm-up requests; with ``--compile-first`` the job's
own request (the first ``--words`` prompt, cut by ``compile_ahead_request``) runs through the compile pass, then
that request runs once, timed part by part with its VAE decode (``job`` in the JSON): the first image's wait.

``--edits N`` then runs N edits of one reference image each (``--edit-size``: their sizes, height x width, taken
in turn): the prefill encodes the reference (VAE encoder, ViT), so the first edit meets the encoder's kernels,
which no warm-up request launches. Timed as ``--sizes`` is, with what each part compiled. On a machine without
CUDA (the tiny CPU recipes) the script runs unsynchronised, compiling nothing: a check of its requests only.

``--sizes`` then runs one request of each image size (height x width; the Instruct ratio table's sizes): prefill,
two steps and the VAE decode, and what each compiled. The image heads' and the VAE's kernels take the size
unspecialized (``winograd_triton.SHAPE_ARGS``), so a size after the first should compile nothing.

``OMNI_PROFILE_START_CACHE=DIR`` starts from a copy of the Triton cache ``DIR`` instead of an empty one: for
example one compiled for the GPU's target on a CPU box (``bench/kernel_resources.py`` leaves its binaries in
``TRITON_CACHE_DIR``), to see which compiles it saves. Measured on the H200 (thirty-fourth session): none, the
cache keys did not match; only a cache the GPU host wrote is found.

``--batches`` then decodes that many answers together, one batch after another (prompts of distinct lengths,
``--answers`` tokens each, 16 by default): what a server meets as its answer concurrency changes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

CACHE = tempfile.mkdtemp(prefix="omni-triton-")
os.environ["TRITON_CACHE_DIR"] = CACHE  # before triton is imported: every compile of this run lands here
START_CACHE = os.environ.get("OMNI_PROFILE_START_CACHE")  # a Triton cache copied in first (see the docstring)
if START_CACHE:
    shutil.copytree(START_CACHE, CACHE, dirs_exist_ok=True)

import torch  # noqa: E402

from omni.deployment import prepare  # noqa: E402
from omni.engine_handle import colour_ramp, served_request  # noqa: E402

PARTS = ("prefill", "step1", "step2", "decode")  # a request's parts, each timed alone by parts_first_use
WORDS = "a watercolour of a red fox in a snowy birch forest at dawn with soft light".split()


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="h200_fp8")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (released: 32)")
    p.add_argument("--words", default="3,7,8,12,16,23,31,40", help="prompt lengths in words, one request each")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--warm-up", nargs="?", const="server", choices=("server", "no-edit", "image", "job"),
                   help="first the server's warm-up as omni-run serve runs it (server: the default request, then "
                        "for an Instruct flavour an edit of one reference and a short answer; no-edit: without "
                        "the edit, as before the thirty-sixth session; image: the default request only; job: "
                        "as omni-run generate, only the compile pass of the first prompt's request, which then "
                        "runs whole)")
    p.add_argument("--compile-first", action="store_true",
                   help="serving.compile_first: the warm-up's requests first run once with the Triton kernels "
                        "compiled, not run (omni/compile_pass.py); run once with and once without for the A/B")
    p.add_argument("--launchers-at-first-launch", action="store_true",
                   help="as before the thirty-sixth session: Triton builds each kernel's host launcher at its first "
                        "launch, not the compile scope (triton_compile.build_launchers off; the A/B)")
    p.add_argument("--answers", type=int, default=0, metavar="TOKENS",
                   help="after the warm-up, two text answers of TOKENS greedy tokens, timed apart (Instruct recipes)")
    p.add_argument("--batches", default="", metavar="N,N,...",
                   help="after the answers, batches of N text answers decoded together (Instruct recipes)")
    p.add_argument("--sizes", default="", metavar="HxW,...",
                   help="after the prompts, one request of each image size, height x width (prefill, two steps, "
                        "VAE decode), timed with what it compiled")
    p.add_argument("--edits", type=int, default=0, metavar="N",
                   help="after the sizes, N edits of one reference image each (Instruct recipes): prefill (the "
                        "reference's encode), two steps, VAE decode, timed with what each compiled")
    p.add_argument("--edit-size", default="1024x1024,768x1280", metavar="HxW,...",
                   help="the reference images' sizes, height x width, in turn (default: a square, then another)")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def compiled() -> int:
    """Kernel binaries in the Triton cache (one .cubin per compiled variant)."""
    return len(binaries())


def binaries() -> set[Path]:
    return set(Path(CACHE).rglob("*.cubin"))


def launchers() -> set[Path]:
    """Triton's host launchers in the cache (C, one per kernel signature, built by the host's C compiler)."""
    return set(Path(CACHE).rglob("__triton_launcher*.so"))


def new_binaries(before: set[Path]) -> dict:
    """How many binaries were compiled since ``before`` (a ``binaries()`` set), and of which kernels."""
    new = binaries() - before
    return {"compiled": len(new), "kernels": names(new)}


def names(paths: set[Path]) -> list[str]:
    """The kernels of some binaries, with how many variants of each."""
    stems = sorted(p.stem for p in paths)
    return [f"{n} x{stems.count(n)}" for n in dict.fromkeys(stems)]


def once(fn) -> float:
    """Seconds of one call of ``fn``, device synchronised; no warm-up call (the first use is what is measured)."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_up(engine, deployment, before: int, kind: str, job=None) -> dict:
    """The server's warm-up (``omni.engine_handle``), as ``omni-run serve`` runs it before it reports ready
    (``kind`` image: its default request only; no-edit: without its edit; job: none, only ``job``'s compile pass,
    as ``omni-run generate`` starts)."""
    from omni.engine_handle import compile_ahead_request, serving_scheduler, warm_up_requests

    requests = () if kind == "job" else warm_up_requests(deployment)
    requests = requests[:1] if kind == "image" else requests
    requests = tuple(r for r in requests if not getattr(r, "images", ())) if kind == "no-edit" else requests
    ahead = (compile_ahead_request(deployment, job),) if kind == "job" else ()
    made, l0 = [], len(launchers())
    seconds = once(lambda: made.append(serving_scheduler(engine, deployment.recipe, requests,
                                                         compile_ahead=ahead)))
    return {"kind": kind, "seconds": seconds, "requests": [type(r).__name__ for r in requests],
            "steps": requests[0].steps if requests else None, "compiled": compiled() - before,
            "launchers": len(launchers()) - l0,
            "compile_first": deployment.recipe.serving.compile_first, "compile_pass_s": made[0].compile_pass_s}


def answer_s(engine, tokens: int, seed: int) -> dict:
    """One greedy text answer of ``tokens`` tokens: seconds (prefill and decode) and what it compiled."""
    from omni.request import TextRequest

    b0 = binaries()
    req = TextRequest(prompt="what is in a snowy birch forest at dawn?", max_tokens=tokens, temperature=0.0,
                      seed=seed, stop_ids=())
    s = engine.admit(req)
    seconds = once(lambda: run_answer(engine, s))
    engine.release(s)
    return {"tokens": tokens, "seconds": seconds, **new_binaries(b0)}


def run_answer(engine, s) -> None:
    run_batch(engine, [s])


def run_batch(engine, states: list) -> None:
    engine.prefill(states)
    while not all(s.done for s in states):
        engine.denoise_step([s for s in states if not s.done])


def batch_s(engine, n: int, tokens: int) -> dict:
    """``n`` greedy answers decoded together, prompts of distinct lengths: seconds and what they compiled."""
    from omni.request import TextRequest

    b0 = binaries()
    states = [engine.admit(TextRequest(prompt=" ".join(WORDS[: 3 + i % len(WORDS)]) + f" ({i})?", max_tokens=tokens,
                                       temperature=0.0, seed=i, stop_ids=())) for i in range(n)]
    seconds = once(lambda: run_batch(engine, states))
    for s in states:
        engine.release(s)
    return {"answers": n, "tokens": tokens, "seconds": seconds, **new_binaries(b0)}


def words_request(deployment, words: int, size: int, seed: int):
    """A request whose prompt has ``words`` words, built as the HTTP layer builds it (``served_request``: the
    system-prompt mode resolved), so it meets the step graphs the warm-up captured as a user's would."""
    prompt = " ".join((WORDS * (words // len(WORDS) + 1))[:words])
    return served_request(deployment, prompt=prompt, height=size, width=size, steps=3, seed=seed)


def first_use(engine, deployment, words: int, size: int, seed: int) -> dict:
    """One request whose prompt has ``words`` words (``words_request``): its prefill and first two steps, and
    what they compiled."""
    s = engine.admit(words_request(deployment, words, size, seed))
    b0, l0 = binaries(), launchers()
    prefill = once(lambda: engine.prefill([s]))
    b1, l1 = binaries(), launchers()
    step1, step2 = once(lambda: engine.denoise_step([s])), once(lambda: engine.denoise_step([s]))
    b2, l2 = binaries(), launchers()
    row = {"words": words, "prefix_tokens": s.rows[0].seq.prefix_len, "prefill_s": prefill, "step1_s": step1,
           "step2_s": step2, "compiled_in_prefill": len(b1 - b0), "compiled_in_steps": len(b2 - b1),
           "launchers_in_prefill": len(l1 - l0), "launchers_in_steps": len(l2 - l1),
           "kernels_in_prefill": names(b1 - b0), "kernels_in_steps": names(b2 - b1)}
    engine.release(s)
    return row


def size_first_use(engine, deployment, height: int, width: int, seed: int) -> dict:
    """One request of a ``height`` x ``width`` image: prefill, two steps and the VAE decode, and what each
    compiled (the image heads' and the VAE's kernels meet the size there)."""
    req = served_request(deployment, height=height, width=width, steps=3, seed=seed)
    return {"size": f"{height}x{width}"} | parts_first_use(engine, req)


def edit_first_use(engine, deployment, height: int, width: int, seed: int) -> dict:
    """One edit of a ``height`` x ``width`` reference (a smooth colour ramp): the prefill encodes it (VAE
    encoder, ViT), then two steps and the VAE decode, and what each part compiled."""
    req = served_request(deployment, prompt="make the sky orange", images=(colour_ramp(height, width),), steps=3,
                         seed=seed)
    return {"reference": f"{height}x{width}"} | parts_first_use(engine, req)


def parts_first_use(engine, req) -> dict:
    """``req`` admitted, then its prefill, two steps and its VAE decode, each timed alone with the binaries it
    compiled (count and kernels); released after."""
    s = engine.admit(req)
    row, b, lb = {"prefix_tokens": s.rows[0].seq.prefix_len}, binaries(), launchers()
    run = {"prefill": lambda: engine.prefill([s]), "step1": lambda: engine.denoise_step([s]),
           "step2": lambda: engine.denoise_step([s]), "decode": lambda: engine.decode(s)}
    for part in PARTS:
        row[f"{part}_s"] = once(run[part])
        new, new_l = binaries() - b, launchers() - lb
        row[f"compiled_in_{part}"], row[f"kernels_in_{part}"], b = len(new), names(new), b | new
        row[f"launchers_in_{part}"], lb = len(new_l), lb | new_l
    engine.release(s)
    return row


def hw_of(text: str) -> tuple[int, int]:
    """``"HxW"`` -> (H, W)."""
    h, w = text.lower().split("x")
    return int(h), int(w)


def report(row: dict) -> None:
    print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)


def card_gib() -> int:
    """The card's memory in whole GiB, floored as the recipes state it (H200: 139, H100: 79), so an H200 recipe
    at a few layers also runs on an H100."""
    return int(torch.cuda.get_device_properties(0).total_memory / 2**30)


@torch.inference_mode()
def main() -> int:
    a = parse()
    if a.launchers_at_first_launch:
        from omni.platforms.cuda import triton_compile

        triton_compile.build_launchers = lambda kernels, pool: 0
    memory = {"device.memory_gib": card_gib()} if torch.cuda.is_available() else {}  # a CPU recipe keeps its own
    deployment = prepare(a.recipe, overrides=memory | {"serving.compile_first": a.compile_first},
                         random_weights=True)
    t0 = time.perf_counter()
    engine = deployment.build_pipeline(random_layers=a.layers, progress=False)
    before, launchers_built = compiled(), len(launchers())
    print(f"built in {time.perf_counter() - t0:.1f} s; {before} Triton kernels compiled while building, "
          f"{launchers_built} launchers", flush=True)
    words = [int(w) for w in a.words.split(",")]
    job = words_request(deployment, words[0], a.size, seed=1000) if a.warm_up == "job" else None
    warm = warm_up(engine, deployment, before, a.warm_up, job) if a.warm_up else None
    if warm:
        print(f"warm-up {warm['seconds']:.1f} s ({warm['requests']}), {warm['compiled']} kernels compiled, "
              f"{warm['launchers']} launchers built; "
              f"compile pass {warm['compile_pass_s']} s", flush=True)
    job_row = None if job is None else parts_first_use(engine, job)
    if job_row:
        job_row["first_image_s"] = warm["seconds"] + sum(job_row[f"{part}_s"] for part in PARTS)
        report({"job": "", **job_row})
    answers = [answer_s(engine, a.answers, seed=i) for i in range(2)] if a.answers else []
    for i, row in enumerate(answers):
        print(f"answer {i + 1}: {row['seconds']:.2f} s for {row['tokens']} tokens, {row['compiled']} compiled "
              f"{row['kernels']}", flush=True)
    batches = [batch_s(engine, int(n), a.answers or 16) for n in a.batches.split(",") if n]
    for row in batches:
        print(f"batch of {row['answers']}: {row['seconds']:.2f} s for {row['tokens']} tokens each, "
              f"{row['compiled']} compiled {row['kernels']}", flush=True)
    rows = []
    for i, n in enumerate(words):
        rows.append(first_use(engine, deployment, n, a.size, seed=i))
        report(rows[-1])
    sizes = []
    for i, hw in enumerate(v for v in a.sizes.split(",") if v):
        sizes.append(size_first_use(engine, deployment, *hw_of(hw), seed=100 + i))
        report(sizes[-1])
    edits, edit_sizes = [], [v for v in a.edit_size.split(",") if v]
    for i in range(a.edits):
        edits.append(edit_first_use(engine, deployment, *hw_of(edit_sizes[i % len(edit_sizes)]), seed=200 + i))
        report(edits[-1])
    start = START_CACHE and f"a copy of {START_CACHE} ({len(list(Path(START_CACHE).rglob('*.cubin')))} binaries)"
    out = {"recipe": a.recipe, "layers": a.layers, "size": a.size, "triton_cache": start or "empty at start",
           "compiled_while_building": before, "launchers_after_build": launchers_built,
           "launchers_at_first_launch": a.launchers_at_first_launch, "warm_up": warm, "job": job_row,
           "answers": answers, "batches": batches,
           "requests": rows, "sizes": sizes, "edits": edits,
           "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
