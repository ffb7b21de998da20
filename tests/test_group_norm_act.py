"""The one-pass "GroupNorm [, FiLM], SiLU" seam (``omni.group_norm.group_norm_act``, the glue's optional
``group_norm``) and the channels-last VAE decoder, on the CPU.

The definition must be the model's own torch ops, rounding for rounding (the image heads' bf16 chain, the
VAE's fp32 chain); modules handed a kernel must call it with the dtypes that chain implies; the channels-last
decoder must give the NCDHW decoder's pixels (and the golden ones, where the golden set is present).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni.group_norm import FusableGroupNorm, GroupNorm, channels_last, group_norm_act, use_group_norm_kernel
from omni.models.hunyuan_image3.image_io import GroupNorm32, ResBlock
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig
from omni.models.hunyuan_image3.vae_blocks import channels_to_space, repeat_channels
from omni.platform_manager import select

from test_golden_vae import GOLDEN_JSON, GOLDEN_TENSORS, golden, vae_weights  # noqa: F401 (fixtures)


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Recording:
    """A kernel double: records each call's dtypes and answers with the definition itself."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, num_groups, weight, bias, eps, **chain):
        self.calls.append((x.dtype, chain["norm_dtype"], chain["out_dtype"], chain["silu"],
                           chain.get("scale_BC") is not None))
        return group_norm_act(x, num_groups, weight, bias, eps, **chain)


def test_the_definition_is_the_image_heads_bf16_chain_bit_for_bit():
    norm = GroupNorm32(64, torch.bfloat16)
    norm.weight.data, norm.bias.data = (_randn(64, seed=1, dtype=torch.bfloat16),
                                        _randn(64, seed=2, dtype=torch.bfloat16))
    x = (_randn(2, 64, 5, 7, seed=3) * 3 + 1).to(torch.bfloat16)
    scale, shift = _randn(2, 64, seed=4, dtype=torch.bfloat16), _randn(2, 64, seed=5, dtype=torch.bfloat16)
    chain = F.silu(norm(x) * (1 + scale[..., None, None]) + shift[..., None, None])  # ResBlock's ops before
    fused = group_norm_act(x, 32, norm.weight, norm.bias, norm.eps, norm_dtype=torch.bfloat16,
                           out_dtype=torch.bfloat16, silu=True, scale_BC=scale, shift_BC=shift)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, chain)
    assert torch.equal(norm.silu(x, scale, shift), chain)  # no kernel: the module keeps those ops


def test_the_definition_is_the_vaes_fp32_chain_rounded_where_the_conv_casts():
    x = _randn(1, 32, 2, 6, 6, seed=6) * 2 - 5
    w, b = _randn(32, seed=7), _randn(32, seed=8)
    chain = F.silu(F.group_norm(x, 32, w, b, 1e-6)).to(torch.float16)
    fused = group_norm_act(x, 32, w, b, 1e-6, norm_dtype=torch.float32, out_dtype=torch.float16, silu=True)
    assert torch.equal(fused, chain)


def test_a_resblock_with_a_kernel_gives_the_same_tokens_and_passes_the_heads_dtypes():
    block = ResBlock(32, 64, 16, platform=select("cpu"), dtype=torch.bfloat16)
    for p in block.parameters():
        p.data = _randn(*p.shape, seed=p.numel(), dtype=p.dtype) * 0.2
    x, emb = _randn(2, 32, 4, 4, seed=9, dtype=torch.bfloat16), _randn(2, 16, seed=10, dtype=torch.bfloat16)
    before = block(x, emb)
    kernel = Recording()
    assert use_group_norm_kernel(kernel, block) == 2
    assert torch.equal(block(x, emb), before)
    bf = torch.bfloat16
    assert kernel.calls == [(bf, bf, bf, True, False), (bf, bf, bf, True, True)]  # in_layers, then FiLM'd out


def test_the_vae_norm_asks_for_fp32_math_and_fp32_out_without_autocast():
    norm = GroupNorm(32, 64, eps=1e-6)
    x = _randn(1, 64, 1, 4, 4, seed=11)
    kernel = Recording()
    plain = norm.silu(x)
    use_group_norm_kernel(kernel, norm)
    assert torch.equal(norm.silu(x), plain) and kernel.calls == [(torch.float32, torch.float32, torch.float32,
                                                                   True, False)]
    norm.silu(x.to(torch.bfloat16))  # not float32 and no autocast: the module's own ops, no kernel call
    assert len(kernel.calls) == 1


def test_the_vae_norm_under_autocast_with_a_float32_policy_returns_the_autocast_dtype(monkeypatch):
    """CUDA's autocast runs GroupNorm in float32; the fused result is then the conv's fp16 input."""
    from omni import group_norm as gn

    norm = GroupNorm(32, 64, eps=1e-6)
    norm.weight.data, norm.bias.data = _randn(64, seed=12), _randn(64, seed=13)
    x = _randn(1, 64, 2, 4, 4, seed=14)
    kernel = Recording()
    use_group_norm_kernel(kernel, norm)
    monkeypatch.setattr(gn, "autocast_dtype_of_group_norm", lambda x: torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm.silu(x)
    assert kernel.calls == [(torch.float32, torch.float32, torch.bfloat16, True, False)]
    assert torch.equal(y, F.silu(F.group_norm(x, 32, norm.weight, norm.bias, 1e-6)).to(torch.bfloat16))


def test_fusable_norms_are_found_everywhere_in_a_vae():
    cfg = VAEConfig(block_out_channels=(32, 32, 64), latent_channels=4, ffactor_spatial=4, ffactor_temporal=2)
    vae = AutoencoderKLConv3D(cfg)
    every = [m for m in vae.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert every and all(isinstance(m, FusableGroupNorm) for m in every)
    assert use_group_norm_kernel(Recording(), vae) == len(every)


@pytest.mark.parametrize("rt", [1, 2])
def test_channels_last_shuffles_are_the_nchw_ones(rt):
    x = _randn(2, 4 * rt * 3, 2, 3, 5, seed=15)
    cl = x.contiguous(memory_format=torch.channels_last_3d)
    assert channels_last(cl) and not channels_last(x)
    for nchw, nhwc in ((channels_to_space(x, rt), channels_to_space(cl, rt)),
                       (repeat_channels(x, 4), repeat_channels(cl, 4))):
        assert torch.equal(nhwc, nchw) and channels_last(nhwc)
    assert torch.equal(repeat_channels(x, 4), x.repeat_interleave(4, dim=1))


def _tiny_vae(cfg_dict, weights) -> AutoencoderKLConv3D:
    vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg_dict), with_encoder=False).eval()
    vae.load_state_dict({k: v for k, v in weights.items() if k.startswith("decoder.")}, strict=True)
    return vae


def test_a_prepared_channels_last_vae_decodes_the_golden_pixels(golden, vae_weights):  # noqa: F811
    cfg_dict, t = golden
    plain, prepared = _tiny_vae(cfg_dict, vae_weights), _tiny_vae(cfg_dict, vae_weights)
    kernel = Recording()
    prepared.prepare(channels_last=True, group_norm_kernel=kernel)
    convs = [m for m in prepared.modules() if isinstance(m, torch.nn.Conv3d) and m.kernel_size == (3, 3, 3)]
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last_3d) for c in convs)
    z = t["golden.VAE.decode_input_latents"]
    want = plain.decode_image(z)
    got = prepared.decode_image(z)
    assert kernel.calls and all(c[1:] == (torch.float32, torch.float32, True, False) for c in kernel.calls)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    assert (got - t["golden.VAE.decoded"]).abs().max() <= 1e-5


def test_the_model_hands_the_glues_kernel_to_its_heads_only_where_there_is_one(golden_data):
    from golden_utils import build_golden_model

    plain = build_golden_model(golden_data, select("cpu"))
    assert plain.group_norm_kernel is None
    assert all(m.kernel is None for m in plain.modules() if isinstance(m, FusableGroupNorm))
    platform = select("cpu")
    glue = platform.glue
    platform.glue = lambda spec: _WithGroupNorm(glue(spec))
    model = build_golden_model(golden_data, platform)
    norms = [m for m in (model.patch_embed, model.final_layer) for m in m.modules() if isinstance(m, FusableGroupNorm)]
    assert norms and all(m.kernel is model.group_norm_kernel is not None for m in norms)


class _WithGroupNorm:
    """A glue as the reference's plus the optional ``group_norm`` (the definition)."""

    def __init__(self, glue):
        self._glue = glue
        self.group_norm = Recording()

    def __getattr__(self, name):
        return getattr(self._glue, name)
