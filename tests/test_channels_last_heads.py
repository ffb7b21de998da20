"""NHWC image heads (the ``channels_last`` platform capability): the same tokens and velocities as NCHW, the
GroupNorm of a channels-last activation without a copy, and autocast's float32 GroupNorm policy."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omni.group_norm import GroupNorm, _POLICY, parallel_group_norm
from omni.platform_manager import select

from golden_utils import build_golden_model


def platform_with(capability: str):
    platform = select("cpu")
    platform.info = dataclasses.replace(platform.info, capabilities=platform.info.capabilities | {capability})
    return platform


def convs(model) -> list[nn.Conv2d]:
    return [m for head in (model.patch_embed, model.final_layer) for m in head.modules() if isinstance(m, nn.Conv2d)]


@pytest.fixture(scope="module")
def both(golden_data):
    return (build_golden_model(golden_data, select("cpu")),
            build_golden_model(golden_data, platform_with("channels_last")))


def test_the_capability_gives_nhwc_conv_weights_and_only_then(both):
    nchw, nhwc = both
    assert not nchw.channels_last and nhwc.channels_last
    assert all(c.weight.is_contiguous() for c in convs(nchw))
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs(nhwc))
    spatial = [c for c in convs(nhwc) if c.kernel_size == (3, 3) and c.in_channels > 1]  # the others are both
    assert spatial and not any(c.weight.is_contiguous() for c in spatial)


def test_nhwc_heads_give_the_nchw_tokens_and_velocity(both):
    nchw, nhwc = both
    g = torch.Generator().manual_seed(0)
    C, D = nchw.cfg.latent_channels, nchw.cfg.hidden_size
    latents, t = torch.randn(1, C, 5, 7, generator=g), torch.tensor([700.0])
    torch.testing.assert_close(nhwc.image_tokens(latents, t), nchw.image_tokens(latents, t), atol=1e-5, rtol=1e-5)
    h_BhwD = torch.randn(2, 35, D, generator=g)
    v_nhwc, v_nchw = nhwc.velocity(h_BhwD, t.repeat(2), 5, 7), nchw.velocity(h_BhwD, t.repeat(2), 5, 7)
    torch.testing.assert_close(v_nhwc, v_nchw, atol=1e-5, rtol=1e-5)
    assert v_nhwc.is_contiguous()  # the sampler's latents stay NCHW


def test_the_velocity_of_packed_rows_feeds_every_conv_a_channels_last_tensor(both, monkeypatch):
    """The rows are slices of the packed step (a timestep token between them): the head copies them once into one
    channels-last tensor, so no convolution (cuDNN: NHWC) or GroupNorm makes a copy of its own."""
    nchw, nhwc = both
    g = torch.Generator().manual_seed(1)
    D = nhwc.cfg.hidden_size
    packed_TD = torch.randn(2 * 36, D, generator=g)
    rows_BhwD = packed_TD.view(2, 36, D)[:, 1:]  # as the engine passes them: not contiguous
    seen, conv2d = [], F.conv2d
    monkeypatch.setattr(F, "conv2d", lambda x, *a, **k: seen.append(x.is_contiguous(memory_format=torch.channels_last))
                        or conv2d(x, *a, **k))
    v = nhwc.velocity(rows_BhwD, torch.tensor([700.0, 700.0]), 5, 7)
    assert seen and all(seen), seen
    monkeypatch.setattr(F, "conv2d", conv2d)
    torch.testing.assert_close(v, nchw.velocity(rows_BhwD.contiguous(), torch.tensor([700.0, 700.0]), 5, 7),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape, fmt", [((2, 64, 6, 5), torch.channels_last),
                                        ((2, 64, 3, 6, 5), torch.channels_last_3d)])  # heads; the VAE decoder
def test_group_norm_reduces_a_channels_last_input_in_place_and_keeps_its_layout(monkeypatch, shape, fmt):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) * 2 + 3).contiguous(memory_format=fmt)
    w, b = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(64, generator=g, dtype=torch.float64)
    var_mean, reduced = torch.var_mean, []
    monkeypatch.setattr(torch, "var_mean", lambda t, **kw: (reduced.append(t.data_ptr()), var_mean(t, **kw))[1])
    y = parallel_group_norm(x, 32, w, b, 1e-6)
    assert reduced == [x.data_ptr()]  # the moments read x itself, not a reshaped copy
    torch.testing.assert_close(y, F.group_norm(x.contiguous(), 32, w, b, 1e-6), atol=1e-12, rtol=0)
    assert y.is_contiguous(memory_format=fmt) and not y.is_contiguous()


def test_a_float32_autocast_policy_runs_fp32_and_returns_fp32(monkeypatch):
    """Where autocast computes group_norm in float32 (CUDA), the module does so itself; here the CPU's policy
    entry is set to float32 so that branch runs on this machine."""
    m = GroupNorm(num_groups=4, num_channels=16, eps=1e-5)
    x = torch.randn(2, 16, 6, 6).bfloat16()
    monkeypatch.setitem(_POLICY, ("cpu", torch.bfloat16, torch.bfloat16), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.group_norm(x.float(), 4, m.weight, m.bias, 1e-5), atol=1e-6, rtol=1e-6)
