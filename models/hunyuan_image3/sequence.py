"""Text-to-image token sequences for HunyuanImage-3.0, as the official code builds them.

One sequence holds the whole request. Text and special tokens come first,
then the image block the transformer denoises in place::

    <boi> <img_size_1024> <img_ratio_k> <timestep> <img>*(th*tw) <eoi>

Templates (official ``TokenizerWrapper.apply_general_template``):

* ``pretrain`` (base model): ``[bos] system prompt cot image-block``; no
  roles, no separators.
* ``instruct``: ``[bos] system "\\n\\n" "User: " prompt "\\n\\n" "Assistant: "
  cot <answer> image-block </answer> "\\n\\n"``.

Every piece of text is tokenised on its own and the pieces are concatenated
(tokenising the joined string could merge BPE tokens across a boundary and
break parity with the checkpoint's training data).

CFG: the unconditional row is the same template with the user prompt and the
CoT contents (inside ``<think>``/``<recaption>``) replaced one token for one
``<cfg>``; system prompt, role words, markers and the image block stay, so
both rows have the same length and the same image positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .resolution import BASE_SIZE, snap, token_grid
from .tokenizer import Tokenizer

TEMPLATES = ("pretrain", "instruct")
SEP = "\n\n"
COT_MARKERS = (("<think>", "</think>"), ("<recaption>", "</recaption>"))
IMAGE_HEAD_LEN = 4  # <boi> <img_size_1024> <img_ratio_k> <timestep>


@dataclass(frozen=True, kw_only=True, slots=True)
class T2ISequence:
    """One row of a text-to-image batch.

    The image run is ``ids[image_start : image_start + token_h * token_w]``,
    row-major (h outer). ``pos_yx`` holds each token's integer 2-D RoPE
    coordinates: (i, i) for text, a centred grid for the image run.
    """

    ids: tuple[int, ...]
    timestep_index: int
    image_start: int
    token_h: int
    token_w: int
    pos_yx: tuple[tuple[int, int], ...]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def prefix_len(self) -> int:
        """Tokens strictly before ``<timestep>``: the part identical at every step."""
        return self.timestep_index

    @property
    def image_slice(self) -> slice:
        """Positions of the ``<img>`` run (the latent tokens)."""
        return slice(self.image_start, self.image_start + self.token_h * self.token_w)

    def attention_mask(self) -> torch.Tensor:
        """Official generalized-causal mask, bool [L, L], True = may attend.

        Causal everywhere, plus a full block over the ``<img>`` run only:
        ``<timestep>``, ``<boi>`` and ``<eoi>`` stay causal.
        """
        n = len(self.ids)
        mask_LL = torch.ones(n, n, dtype=torch.bool).tril_()
        mask_LL[self.image_slice, self.image_slice] = True
        return mask_LL


@dataclass(frozen=True)
class TextPiece:
    """A piece tokenised on its own; ``droppable`` pieces become <cfg> in the uncond row."""

    text: str
    droppable: bool = False


@dataclass(frozen=True)
class _ImageBlock:
    """Placeholder for the image block inside the list of pieces."""


IMAGE_PIECE = _ImageBlock()


def cot_pieces(cot_text: str | None, *, drop_think: bool = False) -> list[TextPiece]:
    """Split CoT text into marker pieces (kept) and content pieces (droppable).

    Mirrors the official ``get_cot_sections``: a ``<think>`` pair is split out
    first, then a ``<recaption>`` pair, recursing on the text around them;
    text outside any pair is one droppable piece. ``drop_think`` removes the
    think section entirely.
    """
    if not cot_text:
        return []
    for start, end in COT_MARKERS:
        if start in cot_text and end in cot_text:
            before, inner, after = _split_pair(cot_text, start, end)
            kept = ([] if drop_think and start == "<think>"
                    else [TextPiece(start), TextPiece(inner, True), TextPiece(end)])
            return cot_pieces(before, drop_think=drop_think) + kept + cot_pieces(after, drop_think=drop_think)
    return [TextPiece(cot_text, True)]


def _split_pair(text: str, start: str, end: str) -> tuple[str, str, str]:
    """(before start, between start and end, after end) with ``str.split`` semantics.

    Uses the official expressions verbatim so odd inputs (repeated markers)
    split the same way: ``after`` is the text between the first and second end.
    """
    return text.split(start)[0], text.split(start)[1].split(end)[0], text.split(end)[1]


def assistant_pieces(cot_text: str | None, answer: tuple[str, str], drop_think: bool) -> list:
    """CoT pieces, then the image block wrapped in the answer markers.

    CoT text with no marker pair stays one droppable piece without <answer>
    wrapping (base-era ``apply_general_template``, which made the golden data).
    """
    cot = cot_pieces(cot_text, drop_think=drop_think) if cot_text is not None else []
    return cot + [TextPiece(answer[0]), IMAGE_PIECE, TextPiece(answer[1])]


def template_pieces(template: str, prompt: str, system_prompt: str | None,
                    cot_text: str | None, *, drop_think: bool = False) -> list:
    """The ordered pieces of one T2I request for ``template`` (bos excluded)."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown sequence template {template!r}; expected one of {TEMPLATES}")
    instruct = template == "instruct"
    sep = SEP if instruct else ""
    answer = ("<answer>", "</answer>") if instruct else ("", "")
    pieces = [TextPiece(system_prompt), TextPiece(sep)] if system_prompt else []
    pieces += [TextPiece("User: " if instruct else ""), TextPiece(prompt, True), TextPiece(sep)]
    pieces += [TextPiece("Assistant: " if instruct else "")]
    return pieces + assistant_pieces(cot_text, answer, drop_think) + [TextPiece(sep)]


def _image_block(tok: Tokenizer, ratio_k: int, n_image: int, base_size: int = BASE_SIZE) -> list[int]:
    """``<boi> <img_size_B> <img_ratio_k> <timestep> <img>*n <eoi>`` (B = 1024 for the released model)."""
    head = [tok.boi, tok.img_size(base_size), tok.img_ratio(ratio_k), tok.timestep]
    return head + [tok.img] * n_image + [tok.eoi]


def _encode_row(tok: Tokenizer, pieces: list, image_ids: list[int], uncond: bool) -> tuple[list[int], int]:
    """(bos + every piece's ids, index of <boi>); droppable pieces become <cfg> when ``uncond``.

    The block position is recorded, not searched for, so a prompt that spells
    out a special token ("<timestep>") cannot move the image run.
    """
    ids, boi_index = [tok.bos], -1
    for piece in pieces:
        if piece is IMAGE_PIECE:
            boi_index = len(ids)
            ids += image_ids
            continue
        piece_ids = tok.encode(piece.text)
        ids += [tok.cfg] * len(piece_ids) if uncond and piece.droppable else piece_ids
    return ids, boi_index


def rope_positions(n: int, image_start: int, token_h: int, token_w: int) -> tuple[tuple[int, int], ...]:
    """Integer (y, x) per token: (i, i) for text, a centred grid for the image.

    The grid sits in the middle of its 1-D span [L, L + h*w): row r, column c
    gets (floor(L + (h*w - h)/2 + r), floor(L + (h*w - w)/2 + c)), truncated
    like the official ``.long()``. Tokens after the run keep (i, i).
    """
    n_image = token_h * token_w
    beta_y = image_start + (n_image - token_h) / 2
    beta_x = image_start + (n_image - token_w) / 2
    grid = [(int(beta_y + r), int(beta_x + c)) for r in range(token_h) for c in range(token_w)]
    text_before = [(i, i) for i in range(image_start)]
    text_after = [(i, i) for i in range(image_start + n_image, n)]
    return tuple(text_before + grid + text_after)


def _to_sequence(ids: list[int], boi_index: int, token_h: int, token_w: int) -> T2ISequence:
    """Wrap a row's ids; <timestep> is the 4th block token and the run follows it."""
    timestep_index = boi_index + IMAGE_HEAD_LEN - 1
    image_start = timestep_index + 1
    return T2ISequence(
        ids=tuple(ids), timestep_index=timestep_index, image_start=image_start,
        token_h=token_h, token_w=token_w,
        pos_yx=rope_positions(len(ids), image_start, token_h, token_w),
    )


def build_t2i_pair(tok: Tokenizer, prompt: str, *, template: str, height: int, width: int,
                   downsample: int, system_prompt: str | None = None, cot_text: str | None = None,
                   cfg: bool = True, drop_think: bool = False,
                   extra_ratios: bool = False, base_size: int = BASE_SIZE) -> tuple[T2ISequence, ...]:
    """Build the conditional row, then (when ``cfg``) the unconditional one.

    ``height``/``width`` are the requested pixels; they are snapped to the
    nearest-ratio table row, which fixes ``<img_ratio_k>`` and the token grid
    (``extra_ratios`` adds the Instruct rows k 33..36). ``downsample`` is
    vae_downsample_factor * patch_size (16 for the released model).
    ``system_prompt`` is the text itself (see ``system_prompts.resolve_system_prompt``).
    ``base_size`` is the checkpoint's ``image_base_size``: its ratio table and ``<img_size_B>``.
    """
    ratio_k, h_px, w_px = snap(height, width, extra=extra_ratios, base=base_size)
    token_h, token_w = token_grid(h_px, w_px, downsample)
    pieces = template_pieces(template, prompt, system_prompt, cot_text, drop_think=drop_think)
    image_ids = _image_block(tok, ratio_k, token_h * token_w, base_size)
    rows = (False, True) if cfg else (False,)
    return tuple(_to_sequence(*_encode_row(tok, pieces, image_ids, u), token_h, token_w) for u in rows)
