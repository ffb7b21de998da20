"""Golden test: the from-scratch HunyuanImage-3.0 VAE against the official code.

The reference tensors in ../shared/golden were produced on the CPU in float32
by the official AutoencoderKLConv3D (Tencent-Hunyuan/HunyuanImage-3.0, commit
1d011c84) with the tiny config and seeded random weights.
"""
from __future__ import annotations

import json

import pytest
import torch

from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig

from golden_utils import GOLDEN_DIR
GOLDEN_JSON = GOLDEN_DIR / "hunyuan_image3_tiny.json"
GOLDEN_TENSORS = GOLDEN_DIR / "hunyuan_image3_tiny.safetensors"
ATOL = 1e-5


@pytest.fixture(scope="module")
def golden():
    """(tiny config dict, every stored tensor). Skips if the golden files are absent."""
    if not (GOLDEN_JSON.is_file() and GOLDEN_TENSORS.is_file()):
        pytest.skip(f"golden data not found in {GOLDEN_DIR} (expected ../shared/golden beside the repo)")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    meta = json.loads(GOLDEN_JSON.read_text())
    return meta["tiny_config"]["vae"], safetensors_torch.load_file(str(GOLDEN_TENSORS))


@pytest.fixture(scope="module")
def vae_weights(golden):
    _, tensors = golden
    return {k.removeprefix("vae."): v for k, v in tensors.items() if k.startswith("vae.")}


@pytest.fixture(scope="module")
def vae(golden, vae_weights):
    cfg = VAEConfig.from_dict(golden[0])
    model = AutoencoderKLConv3D(cfg).eval()
    model.load_state_dict(vae_weights, strict=True)
    return model


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_decode_image_matches_golden(golden, vae):
    """Pipeline path: z / scaling_factor, unsqueeze T, decode, keep the last frame."""
    _, t = golden
    x_B3HW = vae.decode_image(t["golden.VAE.decode_input_latents"])
    assert _max_err(x_B3HW, t["golden.VAE.decoded"]) <= ATOL


def test_encode_matches_golden(golden, vae):
    """The image is expanded to ffactor_temporal frames inside; T is squeezed on the way out."""
    _, t = golden
    with torch.no_grad():
        mean, logvar = vae.encode(t["golden.VAE.encode_input_image"])
    assert _max_err(mean, t["golden.VAE.encode_mean"]) <= ATOL
    assert _max_err(logvar, t["golden.VAE.encode_logvar"]) <= ATOL


def test_encode_image_is_scaled_mean(golden, vae):
    _, t = golden
    z = vae.encode_image(t["golden.VAE.encode_input_image"])
    expected = t["golden.VAE.encode_mean"] * vae.cfg.scaling_factor
    assert _max_err(z, expected) <= ATOL


def test_state_dict_round_trip(vae, vae_weights):
    sd = vae.state_dict()
    assert sorted(sd) == sorted(vae_weights)
    for key, value in vae_weights.items():
        assert torch.equal(sd[key], value), key


def test_misshaped_key_raises(golden, vae_weights):
    model = AutoencoderKLConv3D(VAEConfig.from_dict(golden[0]))
    bad = dict(vae_weights)
    key = "decoder.up.0.upsample.conv.weight"
    bad[key] = torch.zeros(bad[key].shape[0] + 1, *bad[key].shape[1:])
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(bad, strict=True)


def test_config_rejects_unknown_and_unsupported_keys(golden):
    cfg_dict = dict(golden[0])
    with pytest.raises(ValueError, match="bogus"):
        VAEConfig.from_dict({**cfg_dict, "bogus": 1})
    with pytest.raises(ValueError, match="upsample_match_channel"):
        VAEConfig.from_dict({**cfg_dict, "upsample_match_channel": False})
