"""The answer's text grows from a short window of tokens per step (``text_steps._extend_text``), and the finished
answer is detokenized whole.

A byte-level BPE trained here on text with multi-byte characters (accents,
CJK, emoji: tokens that end inside a character) stands in for the released
tokenizer. Checked: every text published on the way is a prefix of the final
one once a trailing replacement character is held back (as the stream does),
the final text equals the whole answer's decode, and the tokens decoded over
an answer grow linearly with its length, not quadratically.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from omni.request import TextRequest
from omni.text_steps import INCOMPLETE, TextState, emit

TEXT = ("héllo wörld, the cat sat on the mat. 猫が座った。 naïve café 🐱🐶 déjà vu, ünïcödé ✓ "
        "the quick brown fox jumps over the lazy dog; 北京 上海 東京 ") * 4


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def answer(tokenizer, ids, stop=None):
    """Emit ``ids`` one by one; (texts published while running, the finished state, ids decoded in all)."""
    decoded = []

    def detokenize(xs):
        decoded.append(len(xs))
        return tokenizer.decode(xs)

    engine = SimpleNamespace(model=SimpleNamespace(detokenize=detokenize))
    s = TextState(TextRequest(prompt="p", max_tokens=len(ids), stop_ids=()), [], 0,
                  frozenset() if stop is None else frozenset({stop}), 1)
    texts = []
    for token in ids:
        emit(engine, s, token)
        if not s.done:
            texts.append(s.text)
    return texts, s, sum(decoded)


def test_texts_on_the_way_are_prefixes_of_the_exact_final_text(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    pieces = [i for i in ids if INCOMPLETE in tokenizer.decode([i])]
    assert pieces, "the text must have tokens that end inside a character"
    texts, s, _ = answer(tokenizer, ids)
    assert s.finish_reason == "length" and s.text == tokenizer.decode(ids) == TEXT
    assert all(s.text.startswith(t.rstrip(INCOMPLETE)) for t in texts)
    assert texts[-1] and len(set(texts)) > len(ids) // 2, "the text grows as the tokens come"


def test_a_stop_token_is_not_in_the_text(tokenizer):
    ids = tokenizer.encode(TEXT).ids[:40]
    stop = ids[-1]
    first = ids.index(stop)
    texts, s, _ = answer(tokenizer, ids[: first + 1], stop=stop)
    assert s.finish_reason == "stop" and s.text == tokenizer.decode(ids[:first])


def test_tokens_decoded_grow_linearly_with_the_answer(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    _, _, short = answer(tokenizer, ids[: len(ids) // 4])
    _, _, full = answer(tokenizer, ids)
    # each step decodes a window of a few tokens, plus the whole answer once at the end
    assert full < 8 * len(ids) and full / short < 4 * 1.5, (short, full, len(ids))
