"""Regenerate ``tiny_tokenizer.json`` from the golden data's 64-entry vocabulary.

The golden sequences were tokenised by a ``tokenizers`` WordLevel model over
``tiny_vocab`` with a whitespace-split pre-tokenizer. Every ``<...>`` entry is
also registered as a special added token, as in the real checkpoint, so
markers glued to text ("<recaption>a photo") still split out. No new ids are
created: each added token already has its vocabulary id.

Usage: python make_tiny_tokenizer.py [path/to/hunyuan_image3_tiny.json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import tokenizers
from tokenizers import models, pre_tokenizers

HERE = Path(__file__).resolve().parent
DEFAULT_GOLDEN = HERE.parents[3] / "shared" / "golden" / "hunyuan_image3_tiny.json"


def build(vocab: dict[str, int]) -> tokenizers.Tokenizer:
    """WordLevel over ``vocab``, whitespace split, ``<...>`` entries special."""
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    specials = sorted((t for t in vocab if t.startswith("<") and t.endswith(">")), key=vocab.get)
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    if tok.get_vocab_size(with_added_tokens=True) != len(vocab):
        raise RuntimeError("adding special tokens created new ids")
    return tok


def main(golden_json: Path) -> None:
    vocab = json.loads(golden_json.read_text())["tiny_vocab"]
    build(vocab).save(str(HERE / "tiny_tokenizer.json"), pretty=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_GOLDEN)
