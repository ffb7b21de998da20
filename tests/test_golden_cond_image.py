"""Golden test: the VAE half of Instruct conditioning images and the Instruct image-size rule.

The reference tensors in ../shared/golden/hunyuan_image3_instruct_tiny.* were
produced on the CPU in float32 by the official Instruct-era code
(Tencent-Hunyuan/HunyuanImage-3.0 at 6e9113a) with the tiny config (image_base_size
256, a tiny encoder-only VAE of factor 64) and seeded random weights. cases.SIZE
uses the real settings (base 1024, VAE factor 16).

The tiled-encode tests at the end need no golden data.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from omni.models.hunyuan_image3.cond_image import draw_eps, posterior, sample_latents, vae_input
from omni.models.hunyuan_image3.resolution import INSTRUCT_EXTRA, instruct_size, instruct_table, ratio_table, token_grid
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig
from omni.vae_tiling import tiled_encode

ATOL = 1e-5  # fp32 on the CPU; measured worst: 2.1e-6 (posterior), 1.7e-6 (latents), 2.4e-7 (eps)


@pytest.fixture(scope="module")
def golden(instruct_golden):
    """(json description, every stored tensor) of the Instruct-era set (tests/conftest.py loads it once)."""
    return instruct_golden


@pytest.fixture(scope="module")
def vae(golden):
    meta, t = golden
    model = AutoencoderKLConv3D(VAEConfig.from_dict(meta["tiny_config"]["vae"])).eval()
    model.load_state_dict({k.removeprefix("vae."): v for k, v in t.items() if k.startswith("vae.")}, strict=True)
    return model


@pytest.fixture(scope="module")
def table(golden):
    return instruct_table(golden[0]["tiny_config"]["image_base_size"])


@pytest.fixture(scope="module")
def posteriors(golden, vae, table):
    """name -> (mean, logvar) of the golden source images through vae_input and posterior."""
    _, t = golden
    return {n: posterior(vae, vae_input(t[f"golden.IMG.{n}.source_rgb_uint8"], table)[0]) for n in "AB"}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ---- VAE input and posterior -------------------------------------------------------------

@pytest.mark.parametrize("name", ["A", "B"])
def test_vae_pixels_are_exact(golden, table, name):
    """Snap the SOURCE size, LANCZOS cover + centre crop, x/255 -> [-1, 1]: bit-identical."""
    meta, t = golden
    case = meta["cases"]["IMG"][name]
    pixels, hw, k = vae_input(t[f"golden.IMG.{name}.source_rgb_uint8"], table)
    assert list(hw) == case["vae_hw"] and k == case["vae_ratio_index"]
    assert torch.equal(pixels[0], t[f"golden.IMG.{name}.vae_pixels"])
    factor = meta["tiny_config"]["vae_downsample_factor"][0]
    assert list(token_grid(*hw, factor)) == case["vae_token_hw"]


@pytest.mark.parametrize("name", ["A", "B"])
def test_posterior_matches_golden(golden, posteriors, name):
    _, t = golden
    mean, logvar = posteriors[name]
    assert _max_err(mean, t[f"golden.IMG.{name}.vae_posterior_mean"]) <= ATOL
    assert _max_err(logvar, t[f"golden.IMG.{name}.vae_posterior_logvar"]) <= ATOL


# ---- posterior samples and the gen-image noise after them ---------------------------------

def _case(golden, posteriors, name):
    meta, t = golden
    case = meta["cases"][name]
    return case, t, [posteriors[n] for n in case["cond_images"]], meta["tiny_config"]["vae"]["scaling_factor"]


@pytest.mark.parametrize("name, derived", [("IT2I_1", ["cond0_vae_eps_derived"]),
                                           ("IT2I_2", ["cond0_vae_eps_derived", "cond1_vae_eps_derived"])])
def test_eps_drawn_in_order_from_the_case_seed(golden, posteriors, name, derived):
    case, t, posts, _ = _case(golden, posteriors, name)
    eps = draw_eps(posts, torch.Generator().manual_seed(case["seed"]))
    assert len(eps) == len(derived)
    for e, key in zip(eps, derived):
        assert _max_err(e[0], t[f"golden.{name}.{key}"]) <= ATOL


def _latents_then_noise(case, t, posts, sf, name):
    g = torch.Generator().manual_seed(case["seed"])
    latents = sample_latents(posts, g, sf)
    xt = t[f"golden.{name}.latents_xt"]
    noise = torch.randn(xt.shape, generator=g, dtype=torch.bfloat16).float()  # as the pipeline's ``noise``
    return latents, noise, xt


def test_one_cond_image_latent_and_noise(golden, posteriors):
    case, t, posts, sf = _case(golden, posteriors, "IT2I_1")
    latents, noise, xt = _latents_then_noise(case, t, posts, sf, "IT2I_1")
    for row in t["golden.IT2I_1.cond_vae_latents"]:  # both CFG rows carry the same latent
        assert _max_err(latents[0][0], row) <= ATOL
    assert list(xt.shape[-2:]) == case["token_hw"]
    assert torch.equal(noise, xt)


def test_two_cond_images_latents_and_noise(golden, posteriors):
    case, t, posts, sf = _case(golden, posteriors, "IT2I_2")
    latents, noise, xt = _latents_then_noise(case, t, posts, sf, "IT2I_2")
    for i, z in enumerate(latents):
        assert _max_err(z[0], t[f"golden.IT2I_2.cond{i}_vae_latent"]) <= ATOL
    assert torch.equal(noise, xt)


def test_noise_depends_on_the_cond_images(golden, posteriors):
    """Drawing the noise without the cond-image draws first gives a different x_t."""
    case, t, _, _ = _case(golden, posteriors, "IT2I_1")
    xt = t["golden.IT2I_1.latents_xt"]
    fresh = torch.randn(xt.shape, generator=torch.Generator().manual_seed(case["seed"]), dtype=torch.bfloat16)
    assert not torch.equal(fresh.float(), xt)


# ---- the Instruct size rule and table -----------------------------------------------------

def test_size_table_is_the_official_one(golden):
    assert [tuple(r) for r in golden[0]["cases"]["SIZE"]["reso_table"]] == [(k, *hw) for k, hw in
                                                                           enumerate(instruct_table(1024))]


def test_every_size_row(golden):
    rows = golden[0]["cases"]["SIZE"]["rows"]
    for r in rows:
        request = r["request"] if isinstance(r["request"], str) else tuple(r["request"])
        h, w, k = instruct_size(request, 1024, 16)
        got = (h, w, *token_grid(h, w, 16), k, f"<img_ratio_{k}>")
        want = (r["resolved_h"], r["resolved_w"], r["token_h"], r["token_w"], r["ratio_index"], r["ratio_token"])
        assert got == want, r["request"]
    assert len(rows) == 31


def test_cond_image_target_sizes(golden):
    table = instruct_table(1024)
    for r in golden[0]["cases"]["SIZE"]["cond_image_target_sizes"]:
        w, h = r["source_wh"]
        image = torch.zeros(h, w, 3, dtype=torch.uint8)
        pixels, (H, W), k = vae_input(image, table)
        assert [W, H] == r["target_wh"] and table[k] == (H, W) and pixels.shape == (1, 3, H, W)


def test_table_comes_from_the_config_base_size(golden):
    """Sorted rows scale with image_base_size (step base/16); the 4 extras stay absolute."""
    base = golden[0]["tiny_config"]["image_base_size"]
    tiny = instruct_table(base)
    assert len(tiny) == 37 and tiny[33:] == INSTRUCT_EXTRA
    assert tiny[0] == (base // 2, base * 2) and tiny[16] == (base, base) and tiny[32] == (base * 2, base // 2)
    assert tiny[:33] == ratio_table(base, base // 16)
    other = instruct_table(512)
    assert other[16] == (512, 512) and other[:33] != tiny[:33] and other[33:] == INSTRUCT_EXTRA
    assert instruct_size("<img_ratio_0>", 512, 16) == (256, 1024, 0)
    assert instruct_size("1:1", base, 64) == (base, base, 16)


def test_bad_requests_are_refused():
    for bad in ("1024", "axb", "<img_ratio_37>", "0x100", (1024,), "1x2x3"):
        with pytest.raises(ValueError):
            instruct_size(bad)
    with pytest.raises(ValueError, match="align"):
        ratio_table(200, align=16)  # step 12 < align 16, as the official assert


def test_only_encoder_vae_has_no_decoder(golden, vae):
    assert vae.decoder is None and vae.cfg.only_encoder
    with pytest.raises(RuntimeError, match="without its decoder"):
        vae.decode_image(torch.zeros(1, 4, 2, 2))


# ---- tiled encode (tiny random VAE, no golden data) ---------------------------------------

TINY = VAEConfig(block_out_channels=(32, 32, 64), latent_channels=4, layers_per_block=1,
                 ffactor_spatial=4, ffactor_temporal=2)


def _tiny_vae() -> AutoencoderKLConv3D:
    torch.manual_seed(0)
    vae = AutoencoderKLConv3D(TINY, with_encoder=True).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(torch.randn_like(p) / max(p[0].numel(), 1) ** 0.5 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    return vae


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_tiled_blend_is_exact_for_a_local_encoder():
    """With a per-pixel-block encoder (no context) the feathered blend must give back the untiled result."""
    x = torch.randn(1, 3, 40, 52, generator=torch.Generator().manual_seed(0))
    tiled = tiled_encode(lambda t: F.avg_pool2d(t, 4), x, tile=4, overlap=2, factor=4)
    torch.testing.assert_close(tiled, F.avg_pool2d(x, 4), atol=1e-6, rtol=0)


def test_tiled_encode_is_close_to_untiled():
    """Measured on this VAE (inputs of seeds 0-3, 48x64 px = 12x16 latents, tile 8 overlap 4):
    relative L2 0.0099-0.0103 (mean) and 0.0120-0.0130 (logvar), max abs 0.49 / 0.63 against
    |mean| up to 13.3; bounded here at 0.02. Tile 10 overlap 6 measured 0.0059-0.0063. The residue
    is the conv context cut at tile borders plus the global mid-block attention."""
    vae = _tiny_vae()
    x = torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    mean, logvar = posterior(vae, x)
    t_mean, t_logvar = posterior(vae, x, tile=8, overlap=4)
    assert t_mean.shape == mean.shape and t_logvar.shape == logvar.shape
    assert _rel(t_mean, mean) < 0.02 and _rel(t_logvar, logvar) < 0.02
    wide = posterior(vae, x, tile=10, overlap=6)[0]
    assert _rel(wide, mean) < _rel(t_mean, mean)  # more overlap, closer
    with torch.no_grad():
        one = tiled_encode(lambda t: torch.cat(vae.encode(t), dim=1), x, tile=16, overlap=4, factor=4)
    torch.testing.assert_close(one, torch.cat([mean, logvar], dim=1), atol=0, rtol=0)  # one tile = untiled


def test_tiled_encode_rejects_a_size_off_the_vae_grid():
    with pytest.raises(ValueError, match="multiple"):
        tiled_encode(lambda t: t, torch.zeros(1, 3, 30, 32), tile=4, overlap=2, factor=4)
