"""Regenerate ``tiny_tokenizer.json`` (and ``tiny_instruct_tokenizer.json``) from the golden vocabulary.

The golden sequences were tokenised by a ``tokenizers`` WordLevel model over
``tiny_vocab`` with a whitespace-split pre-tokenizer. Every ``<...>`` entry is
also registered as a special added token, as in the real checkpoint, so
markers glued to text ("<recaption>a photo") still split out. No new ids are
created: each added token already has its vocabulary id.

``tiny_instruct_tokenizer.json`` (the embedded Instruct checkpoint) is the
same vocabulary plus the Instruct-era specials it lacks (``<img_size_256>``,
the 4 extra ratio rows, ``<timestep_r>``) and a few editing words, appended
after the existing ids. ``tiny_trained/tokenizer.json`` (the trained embedded
default) is the base vocabulary plus ``<img_size_128>`` and the caption words
of the synthetic data set (``trained_vocab``), also appended.

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


INSTRUCT_EXTRA = ["<img_size_256>", "<img_ratio_33>", "<img_ratio_34>", "<img_ratio_35>", "<img_ratio_36>",
                  "<timestep_r>", "make", "it", "blue", "pink", "the", "petals", "neon", "and", "with"]


def instruct_vocab(vocab: dict[str, int]) -> dict[str, int]:
    """The base tiny vocabulary with ``INSTRUCT_EXTRA`` appended (existing ids unchanged)."""
    out = dict(vocab)
    for token in INSTRUCT_EXTRA:
        out.setdefault(token, len(out))
    return out


def trained_vocab(vocab: dict[str, int]) -> dict[str, int]:
    """The vocabulary of the trained embedded default (``tiny_trained/``): the base tiny vocabulary,
    ``<img_size_128>`` and the caption words of ``train_tiny.data`` appended (existing ids unchanged)."""
    from omni.models.hunyuan_image3.train_tiny.data import WORDS

    out = dict(vocab)
    for token in ("<img_size_128>", *WORDS):
        out.setdefault(token, len(out))
    return out


def main(golden_json: Path) -> None:
    vocab = json.loads(golden_json.read_text())["tiny_vocab"]
    build(vocab).save(str(HERE / "tiny_tokenizer.json"), pretty=True)
    build(instruct_vocab(vocab)).save(str(HERE / "tiny_instruct_tokenizer.json"), pretty=True)
    if (HERE / "tiny_trained").is_dir():
        build(trained_vocab(vocab)).save(str(HERE / "tiny_trained" / "tokenizer.json"), pretty=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_GOLDEN)
