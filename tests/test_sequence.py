"""Sequence construction against the official HunyuanImage-3.0 tokenizer wrapper.

The golden rows in ../shared/golden were built by the official
``TokenizerWrapper.apply_chat_template`` (commit 1d011c84) over the tiny
64-entry WordLevel tokenizer; ``vae_downsample_factor`` 256 turns the real
1024-base ratio table into 4x4 (case A) and 3x4 (case B) token grids.
"""
from __future__ import annotations

import json

import pytest
import torch

from omni.models.hunyuan_image3.resolution import (
    INSTRUCT_EXTRA, RESOLUTIONS, rows, snap, token_grid,
)
from omni.models.hunyuan_image3.sequence import build_t2i_pair, cot_pieces
from omni.models.hunyuan_image3.system_prompts import EN_VANILLA, SYSTEM_PROMPTS, resolve_system_prompt
from omni.models.hunyuan_image3.tokenizer import Tokenizer

from golden_utils import GOLDEN_DIR
GOLDEN_JSON = GOLDEN_DIR / "hunyuan_image3_tiny.json"
GOLDEN_TENSORS = GOLDEN_DIR / "hunyuan_image3_tiny.safetensors"
DOWNSAMPLE = 256  # tiny golden vae_downsample_factor
PROMPT = "a red cat on green grass"


@pytest.fixture(scope="module")
def golden():
    """(json metadata, golden.* tensors). Skips if the golden files are absent."""
    if not (GOLDEN_JSON.is_file() and GOLDEN_TENSORS.is_file()):
        pytest.skip(f"golden data not found in {GOLDEN_DIR} (expected ../shared/golden beside the repo)")
    from safetensors import safe_open
    with safe_open(str(GOLDEN_TENSORS), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith("golden.")}
    return json.loads(GOLDEN_JSON.read_text()), tensors


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.tiny()


def build_case(tok, case: dict):
    """Build a golden case from its recorded inputs (image_hw is H, W)."""
    height, width = case["image_hw"]
    return build_t2i_pair(
        tok, case["prompt"], template=case["sequence_template"], height=height, width=width,
        downsample=DOWNSAMPLE, system_prompt=case["system_prompt"], cot_text=case["cot_text"],
    )


# ---- golden parity -------------------------------------------------------------------

def test_tiny_tokenizer_matches_golden_vocab(golden, tok):
    meta, _ = golden
    vocab = meta["tiny_vocab"]
    assert tok.vocab_size == len(vocab) == 64
    assert all(tok.id_of(token) == token_id for token, token_id in vocab.items())


@pytest.mark.parametrize("name", ["A", "B"])
def test_input_ids_both_rows(golden, tok, name):
    meta, tensors = golden
    rows_ = build_case(tok, meta["cases"][name])
    want = tensors[f"golden.{name}.input_ids"].tolist()
    assert [list(r.ids) for r in rows_] == want
    assert len(rows_[0]) == meta["cases"][name]["seq_len"]


def test_token_strings_match_golden_description(golden, tok):
    meta, _ = golden
    seq_a = build_case(tok, meta["cases"]["A"])[0]
    seq_b_cond, seq_b_uncond = build_case(tok, meta["cases"]["B"])
    assert tok.decode(seq_a.ids) == meta["sequence_A_tokens"]
    assert tok.decode(seq_b_cond.ids) == meta["sequence_B_tokens_cond"]
    assert tok.decode(seq_b_uncond.ids) == meta["sequence_B_tokens_uncond"]


@pytest.mark.parametrize("name", ["A", "B"])
def test_image_run_timestep_and_grid(golden, tok, name):
    meta, tensors = golden
    case = meta["cases"][name]
    image_mask = tensors[f"golden.{name}.image_mask"]
    scatter = tensors[f"golden.{name}.gen_timestep_scatter_index"]
    for row, seq in enumerate(build_case(tok, case)):
        mine = torch.zeros(len(seq), dtype=torch.bool)
        mine[seq.image_slice] = True
        assert torch.equal(mine, image_mask[row])
        assert seq.timestep_index == seq.prefix_len == scatter[row, 0].item()
        assert (seq.token_h, seq.token_w) == (case["token_h"], case["token_w"])
        assert [[seq.image_slice.start, seq.image_slice.stop]] == case["image_slices"]


@pytest.mark.parametrize("name", ["A", "B"])
def test_rope_positions(golden, tok, name):
    meta, tensors = golden
    want = [tuple(p) for p in tensors[f"golden.{name}.rope_pos_yx"].tolist()]
    for seq in build_case(tok, meta["cases"][name]):
        assert list(seq.pos_yx) == want


@pytest.mark.parametrize("name", ["A", "B"])
def test_attention_mask(golden, tok, name):
    meta, tensors = golden
    want_B1LL = tensors[f"golden.{name}.attention_mask"]
    for row, seq in enumerate(build_case(tok, meta["cases"][name])):
        assert torch.equal(seq.attention_mask(), want_B1LL[row, 0])


# ---- sequence behaviour without golden data -------------------------------------------

def test_cfg_row_keeps_layout_and_drops_only_prompt_and_cot(tok):
    cond, uncond = build_t2i_pair(
        tok, PROMPT, template="instruct", height=1024, width=1024, downsample=DOWNSAMPLE,
        cot_text="<think>a red cat</think><recaption>a photo of a cat</recaption>",
    )
    assert len(cond) == len(uncond) and cond.pos_yx == uncond.pos_yx
    changed = [i for i, (a, b) in enumerate(zip(cond.ids, uncond.ids)) if a != b]
    assert all(uncond.ids[i] == tok.cfg for i in changed)
    assert len(changed) == 6 + 3 + 5  # prompt, think contents, recaption contents
    assert cond.ids[cond.image_start - 1] == tok.timestep
    assert cond.ids[cond.image_slice.stop] == tok.eoi


def test_no_cfg_gives_one_row(tok):
    (seq,) = build_t2i_pair(tok, PROMPT, template="pretrain", height=1024, width=1024,
                            downsample=DOWNSAMPLE, cfg=False)
    assert seq.ids[0] == tok.bos and seq.ids[-1] == tok.eoi


def test_prompt_spelling_a_special_token_does_not_move_the_image(tok):
    (seq,) = build_t2i_pair(tok, "a <timestep> cat", template="pretrain", height=1024,
                            width=1024, downsample=DOWNSAMPLE, cfg=False)
    assert seq.timestep_index == 1 + 3 + 3  # bos, 3 prompt tokens, boi size ratio


def test_drop_think_removes_think_section():
    pieces = cot_pieces("<think>x</think><recaption>y</recaption>", drop_think=True)
    assert [p.text for p in pieces] == ["<recaption>", "y", "</recaption>"]


def test_unknown_template_is_rejected(tok):
    with pytest.raises(ValueError, match="chat"):
        build_t2i_pair(tok, PROMPT, template="chat", height=1024, width=1024, downsample=16)


# ---- tokenizer -------------------------------------------------------------------------

def test_missing_special_token_is_named(tok):
    with pytest.raises(KeyError, match="<img_ratio_33>"):
        tok.img_ratio(33)


def test_encode_adds_no_special_tokens(tok):
    assert tok.encode(PROMPT) == [51, 52, 53, 54, 55, 56]
    assert tok.encode("") == [] and tok.encode("\n\n") == []


# ---- resolution ------------------------------------------------------------------------

def test_ratio_table_endpoints():
    assert len(RESOLUTIONS) == 33
    assert RESOLUTIONS[0] == (512, 2048)
    assert RESOLUTIONS[16] == (1024, 1024)
    assert RESOLUTIONS[32] == (2048, 512)
    ratios = [h / w for h, w in RESOLUTIONS]
    assert ratios == sorted(ratios)


def test_instruct_extra_rows():
    table = rows(extra=True)
    assert len(table) == 37 and table[33:] == INSTRUCT_EXTRA
    assert table[33] == (1024, 768) and table[36] == (720, 1280)
    assert snap(768, 1024, extra=True)[0] == 35


def test_snap():
    assert snap(1024, 1024) == (16, 1024, 1024)
    assert snap(896, 1152) == (14, 896, 1152)
    assert snap(2000, 2000) == (16, 1024, 1024)  # size picks the aspect only
    assert snap(100, 10_000) == (0, 512, 2048)


def test_token_grid():
    assert token_grid(1024, 1024, 16) == (64, 64)
    assert token_grid(896, 1152, 256) == (3, 4)
    with pytest.raises(ValueError):
        token_grid(8, 8, 16)


# ---- system prompts --------------------------------------------------------------------

def test_system_prompt_modes():
    assert resolve_system_prompt(None) is None and resolve_system_prompt("None") is None
    assert resolve_system_prompt("en_vanilla") == EN_VANILLA
    assert resolve_system_prompt("dynamic", bot_task="image") == EN_VANILLA.strip("\n")
    assert resolve_system_prompt("dynamic", bot_task="think") == SYSTEM_PROMPTS["en_think_recaption"]
    assert resolve_system_prompt("custom", custom="mine") == "mine"
    assert set(SYSTEM_PROMPTS) == {"en_vanilla", "en_recaption", "en_think_recaption", "en_unified"}
    with pytest.raises(ValueError, match="nope"):
        resolve_system_prompt("nope")
