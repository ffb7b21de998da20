"""Host time of an answer's text as it grows: whole-answer detokenizing at every token vs the short window.

A decode step emits a token for every running answer and publishes its text
so far (streams send the differences). Detokenizing the whole answer at
every token costs O(n) a token, O(n^2) an answer; ``text_steps._extend_text``
decodes a window of a few tokens instead and the whole answer once at the
end. With steps launched one ahead of the host, this host time runs beside
the device's step, so it matters once it nears the step (many long answers
at once). The tokenizer: a byte-level BPE trained here on this repository's
text (no download; the released tokenizer is byte-level BPE too). Reports
microseconds per token (mean over an answer) for answers of ``--tokens``
tokens, both ways, in one run.

    python bench/bench_detokenize.py --tokens 256,2048 --json out.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit as emit_json, git_commit  # noqa: E402

from omni.request import TextRequest  # noqa: E402
from omni.text_steps import TextState, emit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def byte_level_bpe(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = [str(p) for p in sorted(ROOT.glob("**/*.md")) + sorted(ROOT.glob("core/*.py"))]
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def windowed_us(tok, ids) -> float:
    engine = SimpleNamespace(model=SimpleNamespace(detokenize=tok.decode))
    s = TextState(TextRequest(prompt="p", max_tokens=len(ids), stop_ids=()), [], 0, frozenset(), 1)
    t0 = time.perf_counter()
    for token in ids:
        emit(engine, s, token)
    assert s.text == tok.decode(ids)
    return 1e6 * (time.perf_counter() - t0) / len(ids)


def whole_us(tok, ids) -> float:
    """What emit did before: the whole answer decoded at every token."""
    t0 = time.perf_counter()
    for n in range(1, len(ids) + 1):
        tok.decode(ids[:n])
    return 1e6 * (time.perf_counter() - t0) / len(ids)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="256,2048")
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    tok = byte_level_bpe(a.vocab)
    ids = tok.encode((ROOT / "BENCHMARKS.md").read_text()).ids
    rows = []
    for n in map(int, a.tokens.split(",")):
        answer = ids[:n]
        whole, windowed = whole_us(tok, answer), windowed_us(tok, answer)
        rows.append({"tokens": n, "whole_us_per_token": round(whole, 1), "window_us_per_token": round(windowed, 1),
                     "ratio": round(whole / windowed, 1)})
        print(rows[-1], flush=True)
    return emit_json({"commit": git_commit(), "vocab": a.vocab, "rows": rows}, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
