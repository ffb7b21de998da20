"""Instruct editing (TI2I) sequences against the official Instruct-era code.

The golden rows in ../shared/golden/hunyuan_image3_instruct_tiny.* were built
by the official ``prepare_model_inputs`` (commit 6e9113a) over a tiny
64-entry WordLevel tokenizer; ``image_base_size`` 256 and downsample 64 give
4x4 / 3x5 conditioning grids and 16 ViT slots.
"""
from __future__ import annotations


import pytest
import torch

from omni.models.hunyuan_image3.edit_sequence import CondImage, build_edit_pair, dense_attention_mask
from omni.models.hunyuan_image3.rope import rope_cos_sin
from omni.models.hunyuan_image3.tokenizer import Tokenizer

CASES = ["IT2I_1", "IT2I_2"]


@pytest.fixture(scope="module")
def golden(instruct_golden):
    """(json description, every stored tensor) of the Instruct-era set (tests/conftest.py loads it once)."""
    return instruct_golden


def vocab_tokenizer(vocab: dict[str, int]) -> Tokenizer:
    """The golden tiny tokenizer: WordLevel + WhitespaceSplit, every <...> entry a special token."""
    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    backend = tokenizers.Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    specials = sorted((t for t in vocab if t.startswith("<") and t.endswith(">")), key=vocab.get)
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in specials])
    return Tokenizer(backend)


@pytest.fixture(scope="module")
def tok(golden):
    return vocab_tokenizer(golden[0]["tiny_vocab"])


def downsample(meta) -> int:
    cfg = meta["tiny_config"]
    return cfg["vae_downsample_factor"][0] * cfg["patch_size"]


def cond_image(meta, name: str) -> CondImage:
    img = meta["cases"]["IMG"][name]
    return CondImage.from_sizes(tuple(img["vae_hw"]), img["vae_ratio_index"], tuple(img["vit_spatial_shape"]),
                                img["vit_tokens"], downsample=downsample(meta))


def build_case(meta, tok, name: str):
    case = meta["cases"][name]
    height, width = case["resolved_image_hw"]
    return build_edit_pair(
        tok, case["prompt"], [cond_image(meta, n) for n in case["cond_images"]], height=height, width=width,
        downsample=downsample(meta), system_prompt=case["system_prompt"], cot_text=case["cot_text"],
        base_size=meta["tiny_config"]["image_base_size"],
    )


def spans(slices) -> list[list[int]]:
    return [list(s) for s in slices]


def test_tokenizer_matches_golden_vocab(golden, tok):
    vocab = golden[0]["tiny_vocab"]
    assert tok.vocab_size == len(vocab)
    assert all(tok.id_of(t) == i for t, i in vocab.items())


def test_cond_image_grids(golden):
    meta, _ = golden
    for name, img in meta["cases"]["IMG"].items():
        im = cond_image(meta, name)
        assert list(im.vae_hw) == img["vae_token_hw"] and im.vit_tokens == img["vit_tokens"]


@pytest.mark.parametrize("name", CASES)
def test_input_ids_both_rows(golden, tok, name):
    meta, tensors = golden
    rows = build_case(meta, tok, name)
    assert [list(r.ids) for r in rows] == tensors[f"golden.{name}.input_ids"].tolist()
    assert all(len(r) == meta["cases"][name]["seq_len"] for r in rows)
    assert tok.decode(rows[0].ids) == meta["sequences"][f"{name}_tokens_row0"]
    assert tok.decode(rows[1].ids) == meta["sequences"][f"{name}_tokens_row1_uncond"]


@pytest.mark.parametrize("name", CASES)
def test_slices_match_case(golden, tok, name):
    meta, _ = golden
    case = meta["cases"][name]
    for row, seq in enumerate(build_case(meta, tok, name)):
        assert spans([seq.image_span]) == case["gen_image_slices"]
        assert spans(c.vae for c in seq.conds) == case["vae_image_slices"]
        assert spans(c.vit for c in seq.conds) == case["vit_image_slices"]
        assert spans(c.joint for c in seq.conds) == case["joint_image_slices"]
        assert spans(seq.full_attention_spans) == case["full_attention_slices"]
        assert [[list(s), list(hw)] for s, hw in seq.rope_image_info] == case["rope_image_info"][row]
        assert seq.image_start - seq.timestep_index == case["num_special_tokens_before_img"]
        assert [seq.token_h, seq.token_w] == case["token_hw"]


@pytest.mark.parametrize("name", CASES)
def test_rope_positions_and_tables(golden, tok, name):
    meta, tensors = golden
    cfg = meta["tiny_config"]
    want_pos = tensors[f"golden.{name}.rope_pos_yx"]
    for row, seq in enumerate(build_case(meta, tok, name)):
        pos_T2 = torch.tensor(seq.pos_yx)
        assert torch.equal(pos_T2, want_pos)  # the golden stores one table; both rows share it
        cos_TH, sin_TH = rope_cos_sin(pos_T2, cfg["attention_head_dim"], cfg["rope_theta"])
        torch.testing.assert_close(cos_TH, tensors[f"golden.{name}.rope_cos"][row], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin_TH, tensors[f"golden.{name}.rope_sin"][row], rtol=0, atol=1e-6)
        assert tensors[f"golden.{name}.position_ids"][row].tolist() == list(range(len(seq)))


@pytest.mark.parametrize("name", CASES)
def test_attention_mask(golden, tok, name):
    meta, tensors = golden
    want_B1LL = tensors[f"golden.{name}.attention_mask"]
    for row, seq in enumerate(build_case(meta, tok, name)):
        assert torch.equal(seq.attention_mask(), want_B1LL[row, 0])
        assert torch.equal(dense_attention_mask(len(seq), meta["cases"][name]["full_attention_slices"]),
                           want_B1LL[row, 0])


@pytest.mark.parametrize("name", CASES)
def test_image_masks_and_timestep_indices(golden, tok, name):
    meta, tensors = golden
    g = lambda key: tensors[f"golden.{name}.{key}"]  # noqa: E731
    for row, seq in enumerate(build_case(meta, tok, name)):
        assert torch.equal(seq.image_mask(), g("image_mask")[row])
        assert torch.equal(seq.cond_vae_mask(), g("cond_vae_image_mask")[row])
        assert torch.equal(seq.cond_vit_mask(), g("cond_vit_image_mask")[row])
        assert seq.timestep_index == seq.prefix_len == g("timesteps_index")[row, 0].item()
        assert list(seq.cond_timestep_indices) == g("cond_timesteps_index")[row].tolist()
        assert all(seq.ids[i] == tok.timestep for i in seq.cond_timestep_indices)
    assert g("cond_timesteps").eq(0).all()  # the conditioning <timestep> is timestep 0


# ---- behaviour without golden data -------------------------------------------------------

def test_uncond_row_keeps_cond_blocks_and_system_prompt():
    tok = Tokenizer.tiny()
    img = CondImage(vae_hw=(2, 3), ratio_index=16, vit_hw=(2, 2), vit_tokens=5)
    cond, uncond = build_edit_pair(tok, "a red cat", [img], height=1024, width=1024, downsample=256,
                                   system_prompt="green grass")
    assert len(cond) == len(uncond) and cond.pos_yx == uncond.pos_yx and cond.conds == uncond.conds
    changed = [i for i, (a, b) in enumerate(zip(cond.ids, uncond.ids)) if a != b]
    assert len(changed) == 3 and all(uncond.ids[i] == tok.cfg for i in changed)
    assert min(changed) > cond.conds[0].vit[1]  # the prompt follows the conditioning block
    (c,) = cond.conds
    assert c.vae[1] - c.vae[0] == 6 and c.vit[1] - c.vit[0] == 5
    assert cond.pos_yx[c.vit[1] - 1] == (c.vit[1] - 1,) * 2  # padded ViT slot stays 1-D
    assert cond.prefix_len > c.vit[1]


def test_cond_image_validation():
    with pytest.raises(ValueError, match="ViT slots"):
        CondImage(vae_hw=(2, 2), ratio_index=0, vit_hw=(3, 3), vit_tokens=8)


@pytest.mark.parametrize("name", ["THINK", "THINK_drop_think"])
def test_no_reference_image_is_the_instruct_text_to_image_row(golden, tok, name):
    """Without reference images the same builder gives the official Instruct T2I rows (CoT included)."""
    meta, t = golden
    case = meta["cases"]["THINK"]
    h, w = (int(v) for v in case["image_size"].split("x"))
    rows = build_edit_pair(tok, case["prompt"], [], height=h, width=w, downsample=downsample(meta),
                           system_prompt=case["system_prompt"], cot_text=case["cot_text"],
                           base_size=meta["tiny_config"]["image_base_size"],
                           drop_think=case["sequences"][name]["drop_think"])
    want = t[f"golden.{name}.input_ids"]
    assert torch.equal(torch.tensor([r.ids for r in rows]), want)
    assert all(r.conds == () for r in rows)
