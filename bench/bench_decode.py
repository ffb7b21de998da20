"""Text decode through a recipe's real pipeline: tokens/s with the decode steps replayed from graphs vs eager.

Text answers (T2T, I2T) and the CoT pass before a ``bot_task`` image (a
rewritten prompt, a reasoning: up to ``cot_max_tokens``, 2048 by default)
decode one token a row per step. A step of a few rows does little work per
kernel, so launching ~100 kernels a layer from Python can cost more than the
kernels. This builds a recipe's pipeline as ``omni-run bench
--full-size-layers`` does (random weights, released widths, layer by layer)
and, on the same engine, times c answers of ``--tokens`` greedy tokens after a
``--prompt-words`` prompt: once with the decode steps eager
(``engine.text_graphs = None``) and once replayed from the pipeline's decode
graphs (``graph.mode: capture``; ``--modes`` adds ``exact``: a graph per row
count instead of per row bucket). ``--staggered`` spreads the answers'
lengths, so they finish one by one and the row count falls from c to 1. Each (mode, c) runs once untimed first (the
captures and JIT compiles land there). Reported: decode tokens/s, ms per step
(the prefill and the first token excluded), the graphs captured and the
memory they reserved.

    python bench/bench_decode.py --recipe h200_instruct_fp8 --layers 32 --json out.json
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402

from omni.deployment import prepare  # noqa: E402
from omni.recipe import parse_overrides  # noqa: E402
from omni.request import TextRequest  # noqa: E402

WORDS = "a red cat on green grass photo of the petals neon pink and blue with".split()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="h200_instruct_fp8", help="a recipe with graph.mode: capture")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (released: 32)")
    p.add_argument("--concurrency", default="1,8,32", help="answers decoding at once, comma-separated")
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per answer (no stop token)")
    p.add_argument("--modes", default="eager,capture", help="comma-separated: eager, capture (row and key "
                   "buckets, what the pipeline runs), exact (a graph per row count: the first version); a _sync "
                   "suffix (capture_sync) reads each step's tokens before launching the next (no lookahead)")
    p.add_argument("--staggered", action="store_true", help="answer lengths spread from tokens/4 to tokens")
    p.add_argument("--distinct", action="store_true", help="each answer its own prompt (the same words from "
                   "another start): by default every answer decodes the same prompt greedily, so all route their "
                   "tokens to the same experts, the MoE's most concentrated case")
    p.add_argument("--memory-gib", type=float, default=139, help="device.memory_gib of the recipe")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, e.g. --set graph.mode=capture (repeatable)")
    p.add_argument("--json", type=Path)
    return p.parse_args()


def answers(c: int, words: int, tokens: int, staggered: bool = False, distinct: bool = False) -> list[TextRequest]:
    """``c`` answers of ``tokens`` tokens; ``staggered``: lengths spread from tokens / 4 to tokens, so the
    answers finish one by one and the row count falls from c to 1 (as a server's mix does); ``distinct``: answer
    i's prompt opens with its number and starts i words further into the list (else all share one prompt)."""
    def prompt(i: int) -> str:
        start = i if distinct else 0
        text = " ".join(WORDS[(start + j * 7) % len(WORDS)] for j in range(words))
        return f"{i}. {text}" if distinct else text
    lengths = ([tokens // 4 + (tokens - tokens // 4) * i // max(c - 1, 1) for i in range(c)] if staggered
               else [tokens] * c)
    return [TextRequest(prompt=prompt(i), max_tokens=n, temperature=0.0, seed=i, stop_ids=())
            for i, n in enumerate(lengths)]


def sync() -> None:
    torch.cuda.synchronize()


@torch.inference_mode()
def decode(engine, requests) -> dict:
    """Prefill ``requests`` together, then step until all are done. The decode loop is timed as a whole (the
    device synchronized before and after it only: a step launched ahead of the last one's read must not be
    waited for at every step, or nothing overlaps)."""
    states = [engine.admit(r) for r in requests]
    try:
        sync()
        t0 = time.perf_counter()
        engine.prefill(states)
        sync()
        prefill_s, steps = time.perf_counter() - t0, 0
        t0 = time.perf_counter()
        while not all(s.done for s in states):
            engine.denoise_step(states)
            steps += 1
        sync()
        decode_s = time.perf_counter() - t0
        tokens = sum(len(s.tokens) - 1 for s in states)  # the first token of each comes from the prefill
        digest = tokens_digest([list(map(int, s.tokens)) for s in states])
    finally:
        for s in states:
            engine.release(s)
    return {"prefill_s": round(prefill_s, 4), "steps": steps, "tokens": tokens,
            "step_ms_mean": round(1e3 * decode_s / steps, 3), "tokens_per_s": round(tokens / decode_s, 1),
            "tokens_sha256": digest}


def tokens_digest(answers_tokens: list[list[int]]) -> str:
    """The first 16 hex digits of the sha256 of every answer's token ids, in order: two runs (other kernels, other
    launches) that decode the same tokens greedily show the same digest."""
    return hashlib.sha256(repr(answers_tokens).encode()).hexdigest()[:16]


def run(engine, graphs, mode: str, c: int, a) -> dict:
    """One (mode, c): eager, capture (row and key buckets) or exact (a graph per row count and linear key
    bucket, as the first version captured); a ``_sync`` suffix reads each step's tokens before the next
    step is launched (``engine.text_lookahead`` off, as before the lookahead)."""
    base, _, sync_suffix = mode.partition("_")
    engine.text_graphs = None if base == "eager" else graphs
    engine.text_row_buckets = base != "exact"
    engine.text_lookahead = sync_suffix != "sync"
    make = lambda: answers(c, a.prompt_words, a.tokens, a.staggered, a.distinct)  # noqa: E731
    t0 = time.perf_counter()
    decode(engine, make())  # untimed: captures, JIT compiles
    first_s = time.perf_counter() - t0
    reserved, captured = torch.cuda.memory_reserved(), graphs.captures
    t0 = time.perf_counter()
    row = {"mode": mode, "concurrency": c, **decode(engine, make())}
    row["first_run_extra_s"] = round(first_s - (time.perf_counter() - t0), 2)  # what the captures/compiles cost
    if base != "eager":
        row.update(graphs_captured=graphs.captures, captured_in_timed_run=graphs.captures - captured,
                   replays=graphs.replays)
    row["reserved_gib"] = round(reserved / 2**30, 2)
    print(row, flush=True)
    return row


def main() -> int:
    a = parse()
    commit = git_commit()
    overrides = {"device.memory_gib": a.memory_gib, **parse_overrides(a.set)}
    deployment = prepare(a.recipe, overrides=overrides, random_weights=True)
    t0 = time.perf_counter()
    engine = deployment.build_pipeline(random_layers=a.layers, progress=False)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    graphs = engine.text_graphs
    if graphs is None:
        raise SystemExit(f"{a.recipe}: no decode graphs (graph.mode must be capture, the model an Instruct one, "
                         "the attention one that reads device lengths)")
    base = torch.cuda.memory_reserved()
    modes = a.modes.split(",")
    rows = [run(engine, graphs, mode, int(c), a) for c in a.concurrency.split(",") for mode in modes]
    for r in rows:
        eager = next((e for e in rows if e["concurrency"] == r["concurrency"] and e["mode"] == "eager"), None)
        if eager is not None and r is not eager:
            r["speedup_vs_eager"] = round(r["tokens_per_s"] / eager["tokens_per_s"], 2)
        sync = next((e for e in rows if e["concurrency"] == r["concurrency"] and e["mode"] == r["mode"] + "_sync"),
                    None)
        if sync is not None:
            r["speedup_vs_sync"] = round(r["tokens_per_s"] / sync["tokens_per_s"], 2)
    out = {"recipe": a.recipe, "overrides": a.set, "layers": a.layers, "prompt_words": a.prompt_words,
           "tokens": a.tokens, "staggered": a.staggered, "distinct": a.distinct,
           "commit": commit, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "reserved_after_build_gib": round(base / 2**30, 2), "rows": rows}
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
