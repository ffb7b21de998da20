"""Text tokenizer for HunyuanImage-3.0: a thin, typed wrapper over ``tokenizers``.

It loads only a checkpoint's ``tokenizer.json`` (plain JSON: no pickles, no
remote code), so it needs neither ``transformers`` nor the official
``HunyuanImage3TokenizerFast``. Sequence layout lives in ``sequence.py``;
this file only maps text to ids and names the special tokens.

``encode`` never adds bos/eos: the sequence builder places them itself, as the
official wrapper does (``encode(text, add_special_tokens=False)``). Added
special tokens written inside the text (``<answer>``) still come out as their
single ids, because ``tokenizers`` always splits registered added tokens.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import tokenizers

TINY_ASSET = "tiny_tokenizer.json"


def _special(token: str) -> property:
    """A read-only property returning the id of ``token`` (KeyError if absent)."""
    return property(lambda self: self.id_of(token), doc=f"Id of the special token {token!r}.")


class Tokenizer:
    """Maps text to ids and names the special tokens the image sequences use."""

    bos = _special("<|startoftext|>")
    eos = _special("<|endoftext|>")
    pad = _special("<pad>")
    boi = _special("<boi>")
    eoi = _special("<eoi>")
    img = _special("<img>")
    cfg = _special("<cfg>")
    timestep = _special("<timestep>")
    answer = _special("<answer>")
    end_of_answer = _special("</answer>")
    think = _special("<think>")
    end_of_think = _special("</think>")
    recaption = _special("<recaption>")
    end_of_recaption = _special("</recaption>")
    img_size_1024 = _special("<img_size_1024>")

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json``, or the one inside a checkpoint directory."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def tiny(cls) -> Tokenizer:
        """The 64-entry WordLevel tokenizer of the tiny golden configuration."""
        asset = resources.files("omni.models.hunyuan_image3.assets") / TINY_ASSET
        return cls(tokenizers.Tokenizer.from_str(asset.read_text(encoding="utf-8")))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with no bos/eos or other template tokens added."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens kept (for logs and debugging)."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def id_of(self, token: str) -> int:
        """Id of one whole token; KeyError naming it if this vocabulary lacks it."""
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise KeyError(f"special token {token!r} is not in this tokenizer's vocabulary")
        return token_id

    def img_size(self, base: int) -> int:
        """Id of ``<img_size_{base}>`` (the table base size, 1024, not the image size)."""
        return self.id_of(f"<img_size_{base}>")

    def img_ratio(self, k: int) -> int:
        """Id of ``<img_ratio_{k}>``; ids are not contiguous past k=32 (Instruct rows)."""
        return self.id_of(f"<img_ratio_{k}>")
