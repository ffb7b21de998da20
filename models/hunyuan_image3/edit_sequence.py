"""Instruct image-editing (TI2I) token sequences for HunyuanImage-3.0, as the official code builds them.

Each conditioning image is one *joint* block in the user turn, before the
prompt text (official ``cond_joint_image`` section)::

    <boi> <img_size_B> <img_ratio_k> <timestep> <img>*(h*w) <joint_img_sep> <img>*P <eoi>

``h x w`` is the image's VAE latent grid, ``k`` its Instruct-table ratio
index, ``P`` the ViT token count (``max_num_patches``: padded patches keep
their slots). The whole Instruct row is::

    [bos] system "\\n\\n" "User: " cond-block* prompt "\\n\\n" "Assistant: "
    cot <answer> gen-block </answer> "\\n\\n"

with the generated image block as in ``sequence.py`` (but ``<img_size_B>``
uses the checkpoint's ``image_base_size``). Every piece is tokenised on its
own. CFG: the unconditional row keeps the system prompt and the conditioning
blocks; only the user text and the CoT contents become ``<cfg>`` (one for
one), so both rows share length, slices and positions.

Structure (official ``cond_token_attn_type`` "joint_full"):

* mask: causal, plus a full block over each joint span (VAE tokens,
  ``<joint_img_sep>``, ViT tokens) and over the generated ``<img>`` run;
  each block's ``<boi>``/size/ratio/``<timestep>``/``<eoi>`` stay causal;
* 2-D RoPE: the VAE grid, the ViT grid over the first ``h_p * w_p`` ViT
  tokens and the generated grid are centred in their 1-D spans (as in
  ``rope.image_positions``); every other token, padded ViT tokens included,
  is (i, i);
* each conditioning ``<timestep>`` gets timestep 0 (``cond_timestep_indices``).

Spans are ``(start, stop)`` index pairs, half open.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .resolution import BASE_SIZE, instruct_size, token_grid
from .sequence import SEP, IMAGE_PIECE, T2ISequence, TextPiece, assistant_pieces
from .tokenizer import Tokenizer

JOINT_SEP = "<joint_img_sep>"
IMAGE_HEAD_LEN = 4  # <boi> <img_size_B> <img_ratio_k> <timestep>

Span = tuple[int, int]


@dataclass(frozen=True, kw_only=True, slots=True)
class CondImage:
    """What a conditioning image contributes to the sequence (no pixels).

    ``vae_hw``: the VAE latent token grid (h, w) of the snapped, cropped
    image; ``ratio_index``: its row in the Instruct ratio table; ``vit_hw``:
    the SigLIP2 patch grid (h_p, w_p); ``vit_tokens``: the ViT slot count
    (``max_num_patches``), at least h_p * w_p.
    """

    vae_hw: tuple[int, int]
    ratio_index: int
    vit_hw: tuple[int, int]
    vit_tokens: int

    def __post_init__(self) -> None:
        if min(*self.vae_hw, *self.vit_hw) < 1 or self.ratio_index < 0:
            raise ValueError(f"conditioning image: bad grids or ratio index in {self}")
        if self.vit_tokens < self.vit_hw[0] * self.vit_hw[1]:
            raise ValueError(f"conditioning image: {self.vit_tokens} ViT slots cannot hold a "
                             f"{self.vit_hw[0]}x{self.vit_hw[1]} patch grid")

    @classmethod
    def from_sizes(cls, vae_px_hw: tuple[int, int], ratio_index: int, vit_hw: tuple[int, int],
                   vit_tokens: int, *, downsample: int) -> CondImage:
        """From ``cond_image.vae_input``'s (H, W) and ratio index and ``vision_preprocess.preprocess``'s grid.

        ``downsample`` is vae_downsample_factor * patch_size; ``vit_tokens``
        is ``max_num_patches`` (the length of ``preprocess``'s mask).
        """
        return cls(vae_hw=token_grid(*vae_px_hw, downsample), ratio_index=ratio_index,
                   vit_hw=tuple(vit_hw), vit_tokens=vit_tokens)

    @property
    def vae_tokens(self) -> int:
        return self.vae_hw[0] * self.vae_hw[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class CondSlots:
    """Where one conditioning image sits in a row."""

    timestep_index: int
    vae: Span
    vit: Span
    vae_hw: tuple[int, int]
    vit_hw: tuple[int, int]

    @property
    def joint(self) -> Span:
        """VAE tokens, ``<joint_img_sep>`` and ViT tokens: the full-attention block."""
        return (self.vae[0], self.vit[1])


@dataclass(frozen=True, kw_only=True, slots=True)
class EditSequence(T2ISequence):
    """One row of an editing batch: a ``T2ISequence`` (``ids``, ``pos_yx``, ``prefix_len``, ``token_h/w``) plus
    ``conds``.

    ``conds`` lists the conditioning images in order. Everything before the
    generated block's ``<timestep>`` (conditioning blocks included) is the
    step-invariant prefix.
    """

    conds: tuple[CondSlots, ...]

    @property
    def image_span(self) -> Span:
        return (self.image_start, self.image_start + self.token_h * self.token_w)

    @property
    def cond_timestep_indices(self) -> tuple[int, ...]:
        """Indices of the conditioning ``<timestep>`` tokens (each gets timestep 0)."""
        return tuple(c.timestep_index for c in self.conds)

    @property
    def full_attention_spans(self) -> tuple[Span, ...]:
        """Joint conditioning spans, then the generated run: the fully visible blocks."""
        return tuple(c.joint for c in self.conds) + (self.image_span,)

    @property
    def rope_image_info(self) -> tuple[tuple[Span, tuple[int, int]], ...]:
        """Official ``rope_image_info`` of the row: (span, grid) for each VAE, ViT and generated slice."""
        cond = [(span, hw) for c in self.conds for span, hw in ((c.vae, c.vae_hw), (c.vit, c.vit_hw))]
        return tuple(cond) + ((self.image_span, (self.token_h, self.token_w)),)

    def attention_mask(self) -> torch.Tensor:
        """Official dense mask, bool [L, L], True = may attend."""
        return dense_attention_mask(len(self.ids), self.full_attention_spans)

    def image_mask(self) -> torch.Tensor:
        """bool [L]: the generated ``<img>`` run."""
        return span_mask(len(self.ids), [self.image_span])

    def cond_vae_mask(self) -> torch.Tensor:
        """bool [L]: every conditioning VAE token."""
        return span_mask(len(self.ids), [c.vae for c in self.conds])

    def cond_vit_mask(self) -> torch.Tensor:
        """bool [L]: every conditioning ViT slot, padded ones included."""
        return span_mask(len(self.ids), [c.vit for c in self.conds])


@dataclass(frozen=True, kw_only=True, slots=True)
class TextRow:
    """The prompt of a text answer (T2T / I2T): ids up to ``Assistant:`` (plus a forced CoT opener).

    The whole row is the prefix; ``conds`` are its reference images, whose
    joint blocks stay fully visible as in an editing row.
    """

    ids: tuple[int, ...]
    pos_yx: tuple[tuple[int, int], ...]
    conds: tuple[CondSlots, ...] = ()
    token_h: int = 0  # no image is generated
    token_w: int = 0

    @property
    def prefix_len(self) -> int:
        return len(self.ids)

    def attention_mask(self) -> torch.Tensor:
        return dense_attention_mask(len(self.ids), [c.joint for c in self.conds])


def span_mask(n: int, spans) -> torch.Tensor:
    """bool [n], True inside any of ``spans``."""
    mask_L = torch.zeros(n, dtype=torch.bool)
    for start, stop in spans:
        mask_L[start:stop] = True
    return mask_L


def dense_attention_mask(n: int, full_spans) -> torch.Tensor:
    """bool [n, n]: causal, plus a full block over each span in ``full_spans``."""
    mask_LL = torch.ones(n, n, dtype=torch.bool).tril_()
    for start, stop in full_spans:
        mask_LL[start:stop, start:stop] = True
    return mask_LL


@dataclass(frozen=True)
class _CondBlock:
    """Placeholder for one conditioning image inside the list of pieces."""

    image: CondImage


def edit_pieces(prompt: str, cond_images, system_prompt: str | None, cot_text: str | None,
                *, drop_think: bool = False) -> list:
    """The ordered pieces of one Instruct editing request (bos excluded)."""
    pieces = [TextPiece(system_prompt), TextPiece(SEP)] if system_prompt else []
    pieces += [TextPiece("User: ")] + [_CondBlock(im) for im in cond_images]
    pieces += [TextPiece(prompt, True), TextPiece(SEP), TextPiece("Assistant: ")]
    return pieces + assistant_pieces(cot_text, ("<answer>", "</answer>"), drop_think) + [TextPiece(SEP)]


def _head(tok: Tokenizer, base_size: int, ratio_index: int) -> list[int]:
    return [tok.boi, tok.img_size(base_size), tok.img_ratio(ratio_index), tok.timestep]


def _cond_block(tok: Tokenizer, image: CondImage, base_size: int, start: int) -> tuple[list[int], CondSlots]:
    """Ids of one joint block whose ``<boi>`` lands at ``start``, and its slots."""
    vae_start = start + IMAGE_HEAD_LEN
    vit_start = vae_start + image.vae_tokens + 1
    ids = _head(tok, base_size, image.ratio_index) + [tok.img] * image.vae_tokens
    ids += [tok.id_of(JOINT_SEP)] + [tok.img] * image.vit_tokens + [tok.eoi]
    slots = CondSlots(timestep_index=vae_start - 1, vae=(vae_start, vit_start - 1),
                      vit=(vit_start, vit_start + image.vit_tokens), vae_hw=image.vae_hw, vit_hw=image.vit_hw)
    return ids, slots


def _encode_row(tok: Tokenizer, pieces: list, gen_ids: list[int], base_size: int,
                uncond: bool) -> tuple[list[int], int, list[CondSlots]]:
    """(ids, index of the generated <boi>, conditioning slots); droppable text becomes <cfg> when ``uncond``.

    Block positions are recorded while encoding, never searched for.
    """
    ids, boi_index, conds = [tok.bos], -1, []
    for piece in pieces:
        if piece is IMAGE_PIECE:
            boi_index = len(ids)
            ids += gen_ids
        elif isinstance(piece, _CondBlock):
            block_ids, slots = _cond_block(tok, piece.image, base_size, len(ids))
            ids += block_ids
            conds.append(slots)
        else:
            piece_ids = tok.encode(piece.text)
            ids += [tok.cfg] * len(piece_ids) if uncond and piece.droppable else piece_ids
    return ids, boi_index, conds


def grid_positions(start: int, h: int, w: int) -> list[tuple[int, int]]:
    """Integer (y, x) of an h x w grid centred in the 1-D span [start, start + h*w), row-major."""
    n = h * w
    return [(start + (n - h + 2 * r) // 2, start + (n - w + 2 * c) // 2) for r in range(h) for c in range(w)]


def rope_positions(n: int, grids) -> tuple[tuple[int, int], ...]:
    """(i, i) everywhere, then each ``((start, stop), (h, w))`` grid over its first h*w tokens."""
    pos = [(i, i) for i in range(n)]
    for (start, _), (h, w) in grids:
        pos[start:start + h * w] = grid_positions(start, h, w)
    return tuple(pos)


def _to_sequence(ids: list[int], boi_index: int, conds: list[CondSlots], token_h: int,
                 token_w: int, specials: int = 1) -> EditSequence:
    """``specials``: tokens from ``<timestep>`` to the image run (3 for Distil: + ``<guidance> <timestep_r>``)."""
    timestep_index = boi_index + IMAGE_HEAD_LEN - 1
    image_start = timestep_index + specials
    grids = [(span, hw) for c in conds for span, hw in ((c.vae, c.vae_hw), (c.vit, c.vit_hw))]
    grids.append(((image_start, image_start + token_h * token_w), (token_h, token_w)))
    return EditSequence(ids=tuple(ids), timestep_index=timestep_index, image_start=image_start,
                        token_h=token_h, token_w=token_w, pos_yx=rope_positions(len(ids), grids),
                        conds=tuple(conds))


def build_text_row(tok: Tokenizer, prompt: str, cond_images=(), *, downsample: int,
                   system_prompt: str | None = None, base_size: int = BASE_SIZE, opener: str | None = None) -> TextRow:
    """The official ``gen_text`` prompt: system, ``User:`` + reference blocks + prompt, ``Assistant:``.

    ``opener`` is text the assistant turn starts with (``<think>`` or
    ``<recaption>`` for the CoT passes); None for a plain answer.
    """
    pieces = [TextPiece(system_prompt), TextPiece(SEP)] if system_prompt else []
    pieces += [TextPiece("User: ")] + [_CondBlock(im) for im in cond_images]
    pieces += [TextPiece(prompt, True), TextPiece(SEP), TextPiece("Assistant: ")]
    pieces += [TextPiece(opener)] if opener else []
    ids, _, conds = _encode_row(tok, pieces, [], base_size, False)
    grids = [(span, hw) for c in conds for span, hw in ((c.vae, c.vae_hw), (c.vit, c.vit_hw))]
    return TextRow(ids=tuple(ids), pos_yx=rope_positions(len(ids), grids), conds=tuple(conds))


def build_edit_pair(tok: Tokenizer, prompt: str, cond_images, *, height: int, width: int,
                    downsample: int, system_prompt: str | None = None, cot_text: str | None = None,
                    cfg: bool = True, base_size: int = BASE_SIZE, drop_think: bool = False,
                    distil: bool = False) -> tuple[EditSequence, ...]:
    """The conditional row, then (when ``cfg``) the unconditional one, of an editing request.

    ``cond_images``: ``CondImage``s in prompt order; none gives the Instruct
    text-to-image row (the instruct template, this size rule).
    ``height``/``width``: the requested output pixels, snapped by the
    Instruct size rule (``resolution.instruct_size``) over the table of
    ``base_size`` (the checkpoint's ``image_base_size``, also the
    ``<img_size_B>`` of every block). ``downsample`` is
    vae_downsample_factor * patch_size. ``system_prompt`` is the text itself.
    ``distil``: the Distil block, ``<timestep> <guidance> <timestep_r>`` before the image run.
    """
    cond_images = tuple(cond_images)
    h_px, w_px, ratio_k = instruct_size((height, width), base_size, downsample)
    token_h, token_w = token_grid(h_px, w_px, downsample)
    extra = [tok.id_of("<guidance>"), tok.id_of("<timestep_r>")] if distil else []
    gen_ids = _head(tok, base_size, ratio_k) + extra + [tok.img] * (token_h * token_w) + [tok.eoi]
    pieces = edit_pieces(prompt, cond_images, system_prompt, cot_text, drop_think=drop_think)
    rows = (False, True) if cfg else (False,)
    return tuple(_to_sequence(*_encode_row(tok, pieces, gen_ids, base_size, u), token_h, token_w, 1 + len(extra))
                 for u in rows)
