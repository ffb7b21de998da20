"""Golden tests: the SigLIP2 naflex ViT and ``vision_aligner`` of HunyuanImage-3.0-Instruct.

The reference tensors in ../shared/golden/hunyuan_image3_instruct_tiny.* were
produced on the CPU in float32 by the official Instruct code (its
Siglip2ImageProcessorFast, Siglip2VisionTransformer and vision_aligner) with
the tiny config (ViT width 32, 1 layer, patch 8, max_num_patches 16) and
seeded weights. Image A (290x300) fills a 4x4 grid, image B (200x330) a 3x5
grid plus one padded patch, so IT2I_2 packs two grids into one forward.

Shape suffixes: B images, P max_num_patches, F values per patch, D ViT width,
M backbone width.
"""
from __future__ import annotations


import pytest
import torch

from omni.build_options import BuildOptions
from omni.platform_manager import select
from omni.weights import CheckpointError
from omni.models.hunyuan_image3.vision import HunyuanVisionEncoder, VisionConfig, load_state
from omni.models.hunyuan_image3.vision_preprocess import VisionInputs, preprocess, target_size

ATOL = 1e-5
PIXEL_ATOL = 1e-6


@pytest.fixture(scope="module")
def golden(instruct_golden):
    """(json description, every stored tensor) of the Instruct-era set (tests/conftest.py loads it once)."""
    return instruct_golden


@pytest.fixture(scope="module")
def g(golden):
    return {k.removeprefix("golden."): v for k, v in golden[1].items() if k.startswith("golden.")}


@pytest.fixture(scope="module")
def cfg(golden):
    return VisionConfig.from_model_config(golden[0]["tiny_config"])


@pytest.fixture(scope="module")
def encoder(golden, cfg):
    m = HunyuanVisionEncoder(cfg, select("cpu"), BuildOptions(dtype=torch.float32))
    load_state(m, golden[1])  # the checkpoint holds vision_model.head.* too: skipped (never read officially)
    m.finalize()
    return m.eval()


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> float:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got.float() - want.float()).abs().max().item()
    print(f"{name}: max abs err {err:.3g}")
    assert err <= atol, f"{name}: max abs err {err}"
    return err


def images(g, golden, case: str) -> list[torch.Tensor]:
    names = golden[0]["cases"][case].get("cond_images") or golden[0]["cases"][case]["images"]
    return [g[f"IMG.{n}.source_rgb_uint8"] for n in names]


# ---------------------------------------------------------------- preprocessing


@pytest.mark.parametrize("name", ["A", "B"])
def test_preprocess_matches_official_processor(g, cfg, name):
    pixels_PF, hw, mask_P = preprocess(g[f"IMG.{name}.source_rgb_uint8"], cfg)
    check(f"IMG.{name}.vit_pixel_values", pixels_PF, g[f"IMG.{name}.vit_pixel_values"], PIXEL_ATOL)
    assert list(hw) == g[f"IMG.{name}.vit_spatial_shapes"].tolist()
    assert torch.equal(mask_P.to(torch.int32), g[f"IMG.{name}.vit_pixel_attention_mask"])


@pytest.mark.parametrize("case", ["IT2I_1", "IT2I_2"])
def test_batch_preprocess_matches_cond_inputs(g, golden, encoder, case):
    inputs = encoder.preprocess(images(g, golden, case))
    check(f"{case}.cond_vit_pixel_values", inputs.pixel_values_BPF, g[f"{case}.cond_vit_pixel_values"], PIXEL_ATOL)
    assert [list(hw) for hw in inputs.spatial_hw] == g[f"{case}.cond_vit_spatial_shapes"].tolist()
    assert torch.equal(inputs.mask_BP.to(torch.int32), g[f"{case}.cond_vit_attention_mask"])


# ---------------------------------------------------------------- ViT and aligner


@pytest.mark.parametrize("case", ["IT2I_1", "IT2I_2"])
def test_vit_and_aligner_match_official(g, golden, encoder, case):
    """IT2I_2: two images of different grids (4x4 and 3x5 + 1 pad) in ONE packed forward."""
    with torch.no_grad():
        h_BPD, feats_BPM = encoder(encoder.preprocess(images(g, golden, case)))
    check(f"{case}.vit_last_hidden_state", h_BPD, g[f"{case}.vit_last_hidden_state"])
    check(f"{case}.vit_aligner_out", feats_BPM, g[f"{case}.vit_aligner_out"])


def test_i2t_aligner_output(g, golden, encoder):
    check("I2T.vit_aligner_out", encoder.encode(images(g, golden, "I2T")), g["I2T.vit_aligner_out"])


def test_load_state_skips_head_and_checks_vision_keys(golden, cfg):
    weights = {k: v for k, v in golden[1].items() if not k.startswith("golden.")}
    assert any(k.startswith("vision_model.head.") for k in weights)
    m = HunyuanVisionEncoder(cfg, select("cpu"), BuildOptions(dtype=torch.float32))
    assert not any(n.startswith("vision_model.head.") for n, _ in m.named_parameters())
    missing = {k: v for k, v in weights.items() if k != "vision_model.post_layernorm.weight"}
    with pytest.raises(CheckpointError, match="post_layernorm.weight"):
        load_state(m, missing)


# ---------------------------------------------------------------- nothing hard-coded


OTHER = VisionConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3, patch_size=4,
                     num_patches=9, max_num_patches=25, aligner_dim=48, aligner_depth=3,
                     image_mean=(0.4, 0.5, 0.6), image_std=(0.2, 0.3, 0.4))


def random_encoder(cfg: VisionConfig) -> HunyuanVisionEncoder:
    m = HunyuanVisionEncoder(cfg, select("cpu"), BuildOptions(dtype=torch.float32))
    gen = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    m.finalize()
    return m.eval()


def random_image(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_config_from_dicts_reads_every_size():
    cfg = VisionConfig.from_dicts(
        {"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 3,
         "patch_size": 4, "num_patches": 9, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
         "num_channels": 3, "_attn_implementation": "sdpa", "output_hidden_states": False},
        {"max_num_patches": 25, "patch_size": 4, "image_mean": [0.4, 0.5, 0.6], "image_std": [0.2, 0.3, 0.4]},
        {"projector_type": "mlp_gelu", "input_dim": 24, "n_embed": 48, "depth": 3})
    assert cfg == OTHER
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_dicts({"hidden_size": 24, "patch_size": 4, "hidden_act": "relu"}, {}, {})


def test_shapes_and_padding_follow_the_config():
    m = random_encoder(OTHER)
    assert [n for n, _ in m.vision_aligner.named_parameters()] == [
        f"layers.{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")]
    assert m.vision_model.embeddings.patch_embedding.weight.shape == (24, 4 * 4 * 3)
    ims = [random_image(37, 61, 1), random_image(90, 20, 2), random_image(8, 8, 3)]
    inputs = m.preprocess(ims)
    assert inputs.pixel_values_BPF.shape == (3, 25, 48) and inputs.mask_BP.shape == (3, 25)
    for (h, w), im, mask_P, px_PF in zip(inputs.spatial_hw, ims, inputs.mask_BP, inputs.pixel_values_BPF):
        assert (4 * h, 4 * w) == target_size(im.shape[0], im.shape[1], 4, 25) and h * w <= 25
        assert int(mask_P.sum()) == h * w and bool(mask_P[: h * w].all())
        assert bool((px_PF[h * w:] == 0).all())
    assert inputs.spatial_hw[2] == (5, 5)  # an 8x8 image is scaled UP to fill the patch budget
    h_BPD, feats_BPM = m(inputs)
    assert h_BPD.shape == (3, 25, 24) and feats_BPM.shape == (3, 25, 48)


def test_packing_keeps_images_apart_and_masks_padded_keys():
    """Packed = one image at a time; padded rows' content never reaches a real row (keys-only mask)."""
    m = random_encoder(OTHER)
    inputs = m.preprocess([random_image(37, 61, 1), random_image(90, 20, 2)])
    with torch.no_grad():
        packed = m(inputs)[1]
        for b, hw in enumerate(inputs.spatial_hw):
            one = VisionInputs(inputs.pixel_values_BPF[b:b + 1], (hw,), inputs.mask_BP[b:b + 1])
            torch.testing.assert_close(m(one)[1], packed[b:b + 1], atol=1e-5, rtol=0)
        noisy = inputs.pixel_values_BPF.masked_fill(~inputs.mask_BP[..., None], 3.0)
        other = m(VisionInputs(noisy, inputs.spatial_hw, inputs.mask_BP))[1]
    real = inputs.mask_BP
    torch.testing.assert_close(other[real], packed[real], atol=1e-5, rtol=0)
    assert not torch.allclose(other[~real], packed[~real])  # padded queries are computed, not zeroed
