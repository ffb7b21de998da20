"""Text answers at the released shapes: time to first token and decode throughput, alone and beside an image.

Through the real scheduler and step engine (``TextRequest``s on the
Instruct pipeline with random weights; the released widths with ``--layers``
of the 32 decoder layers, see bench_edit.py): c concurrent answers of
``--tokens`` greedy tokens each after a ``--prompt-tokens`` prompt, for c in
``--concurrency``; then the same with one 1024x1024 text-to-image request
denoising beside them (its step and theirs share each scheduler iteration,
timed apart). Baseline, same run: the same answers without a KV cache, every
token recomputing the whole sequence (prompt + answer so far) in one causal
forward, as a cache-less decoder does.

Transformer figures scale linearly to 32 layers (``*_32_layers_extrapolated``);
the embedding and the text head do not scale and are small next to the layers.

    python bench/bench_text.py --layers 8 --json bench/results/bench_text_h200.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402
from bench_edit import RELEASED_LAYERS, build, synced  # noqa: E402

from omni import text_steps  # noqa: E402
from omni.kv_pool import Run  # noqa: E402
from omni.platform_manager import select  # noqa: E402
from omni.request import ImageRequest, TextRequest  # noqa: E402
from omni.scheduler import Scheduler  # noqa: E402

WORDS = "a red cat on green grass photo of the petals neon pink and blue with".split()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="answer tokens per request (greedy, no stop token)")
    p.add_argument("--image-size", type=int, default=1024, help="side of the image request beside the answers")
    p.add_argument("--text-tokens-per-image-step", default="1,4",
                   help="serving.text_tokens_per_image_step values to run beside the image")
    p.add_argument("--kv-gib", type=float, default=8.0)
    p.add_argument("--json", type=Path)
    return p.parse_args()


def answers(c: int, prompt_tokens: int, tokens: int) -> list[TextRequest]:
    prompt = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(prompt_tokens))
    return [TextRequest(prompt=prompt, max_tokens=tokens, temperature=0.0, stop_ids=(), request_id=f"t{i}")
            for i in range(c)]


class Timers:
    """Synchronized seconds of the engine's text and image forwards (wrapped for the duration of a run)."""

    def __init__(self, dev, engine):
        self.dev, self.engine, self.text, self.image, self.text_steps, self.image_steps = dev, engine, 0.0, 0.0, 0, 0
        self._decode, self._denoise = text_steps.decode_step, engine._denoise
        text_steps.decode_step = self._timed_text
        engine._denoise = self._timed_image

    def _timed_text(self, engine, states):
        _, dt = synced(self.dev, lambda: self._decode(engine, states))
        self.text, self.text_steps = self.text + dt, self.text_steps + 1

    def _timed_image(self, states):
        _, dt = synced(self.dev, lambda: self._denoise(states))
        self.image, self.image_steps = self.image + dt, self.image_steps + 1

    def close(self):
        text_steps.decode_step, self.engine._denoise = self._decode, self._denoise


def _has_token(t) -> bool:
    """The answer's first token exists (its text may still be empty: random weights write unknown ids)."""
    return t.future.done() or bool(getattr(t.state, "tokens", ()))


def run_scheduled(dev, engine, reqs, image: ImageRequest | None, per_image_step: int = 1) -> dict:
    """Submit, step until every answer is done; TTFT per answer, decode throughput, forward times."""
    sched = Scheduler(engine, max_running=len(reqs) + 1, max_batch_tokens=None,
                      text_tokens_per_image_step=per_image_step)
    timers = Timers(dev, engine)
    try:
        img = sched.submit_many([image])[0] if image is not None else None
        if img is not None:  # the image is already denoising when the answers arrive
            sched.step()
        dev.synchronize()
        t0 = time.perf_counter()
        tickets = sched.submit_many(reqs)
        first: dict[str, float] = {}
        while any(not t.future.done() for t in tickets):
            sched.step()
            dev.synchronize()
            now = time.perf_counter() - t0
            first.update({t.request_id: now for t in tickets if t.request_id not in first and _has_token(t)})
        wall = time.perf_counter() - t0
        if img is not None:
            sched.cancel(img)
            sched.step()
    finally:
        timers.close()
    n = sum(len(t.result(0).token_ids) for t in tickets)
    ttft = sorted(first.values())
    return {"concurrency": len(reqs), "tokens": n, "wall_s": wall, "ttft_mean_s": sum(ttft) / len(ttft),
            "ttft_max_s": ttft[-1], "decode_tokens_per_s": (n - len(reqs)) / max(wall - ttft[-1], 1e-9),
            "text_step_s": timers.text / max(timers.text_steps, 1),
            "image_step_s": timers.image / max(timers.image_steps, 1) if image is not None else None,
            "image_steps_per_s": timers.image_steps / wall if image is not None else None}


@torch.inference_mode()
def run_without_cache(dev, engine, reqs) -> dict:
    """Baseline: the same greedy answers, each token from a causal forward over the whole sequence so far."""
    m, pool = engine.model, engine.pool
    rows = [m.text_row(r) for r in reqs]
    pages = [pool.allocate(len(rows[0].ids) + reqs[0].max_tokens) for _ in reqs]
    seqs = [list(r.ids) for r in rows]
    try:
        dev.synchronize()
        t0 = time.perf_counter()
        for _ in range(reqs[0].max_tokens):
            n = len(seqs[0])
            runs = [Run(tuple(p), 0, n, n) for p in pages]
            x = m.embed([i for s in seqs for i in s])
            pos = [(i, i) for _ in seqs for i in range(n)]
            h = engine._backbone(x, *m.rope(pos), runs, "causal").view(len(seqs), n, -1)[:, -1]
            for s, logits in zip(seqs, m.text_logits(h)):
                s.append(int(logits.argmax()))
        dev.synchronize()
        wall = time.perf_counter() - t0
    finally:
        for p in pages:
            pool.release(p)
    tokens = len(reqs) * reqs[0].max_tokens
    return {"concurrency": len(reqs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def extrapolated(x: float, layers: int) -> float:
    return x * RELEASED_LAYERS / layers


def main() -> int:
    a = parse()
    commit = git_commit()
    platform = select(a.platform)
    dev = platform.device_services(0)
    engine = build(platform, dev, a.layers, a.kv_gib)
    image = ImageRequest(prompt="a red cat", height=a.image_size, width=a.image_size, steps=1000, guidance=5.0, seed=0,
                         template="instruct", request_id="image")
    run_scheduled(dev, engine, answers(2, a.prompt_tokens, 4), None)  # warm-up
    results, shares = [], [int(v) for v in a.text_tokens_per_image_step.split(",")]
    for c in (int(v) for v in a.concurrency.split(",")):
        reqs = answers(c, a.prompt_tokens, a.tokens)
        cached, nocache = run_scheduled(dev, engine, reqs, None), run_without_cache(dev, engine, reqs)
        beside = {k: run_scheduled(dev, engine, reqs, image, k) for k in shares}
        row = {"concurrency": c, "kv_cached": cached, "no_kv_cache_baseline": nocache,
               **{f"beside_image_text_tokens_per_image_step_{k}": v for k, v in beside.items()},
               "speedup_vs_no_cache": cached["decode_tokens_per_s"] / nocache["tokens_per_s"],
               "text_step_s_32_layers_extrapolated": extrapolated(cached["text_step_s"], a.layers)}
        results.append(row)
        side = ", ".join(f"{v['decode_tokens_per_s']:.0f} tok/s / image step {v['image_step_s'] * 1e3:.0f} ms at "
                         f"{k} per image step" for k, v in beside.items())
        print(f"c={c}: {cached['decode_tokens_per_s']:.0f} tok/s cached vs "
              f"{nocache['tokens_per_s']:.0f} without cache; "
              f"TTFT {cached['ttft_mean_s'] * 1e3:.0f} ms; beside an image: {side}", file=sys.stderr)
    out = {"commit": commit, "platform": platform.name, "device": platform.info.device_name, "layers": a.layers,
           "note": f"transformer at {a.layers} of {RELEASED_LAYERS} layers, random weights, greedy",
           "prompt_tokens_words": a.prompt_tokens, "answer_tokens": a.tokens, "results": results}
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
