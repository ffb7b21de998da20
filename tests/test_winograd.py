"""Winograd F(2x2, 3x3) (``omni.winograd``): the definition equals a direct 3x3 convolution, and the image heads
take a glue's ``conv3x3`` at build (weights released, tokens and velocity unchanged within the transform's
roundings)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omni.platform_manager import select
from omni.winograd import (FusableConv3x3, conv3x3_winograd, input_transform, use_conv3x3_kernel,
                           winograd_weights)

from golden_utils import build_golden_model


@pytest.mark.parametrize("B,C,O,H,W", [(1, 8, 5, 6, 6), (2, 3, 4, 5, 7), (1, 16, 16, 1, 1), (2, 4, 3, 2, 9)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_definition_is_a_3x3_convolution_with_padding_1(B, C, O, H, W, bias):
    g = torch.Generator().manual_seed(B * 100 + C * 10 + W)
    x, w = torch.randn(B, C, H, W, generator=g, dtype=torch.float64), torch.randn(O, C, 3, 3, generator=g,
                                                                                   dtype=torch.float64)
    b = torch.randn(O, generator=g, dtype=torch.float64) if bias else None
    addend = torch.randn(B, O, H, W, generator=g, dtype=torch.float64)
    u = winograd_weights(w, torch.float64)
    torch.testing.assert_close(conv3x3_winograd(x, u, b), F.conv2d(x, w, b, padding=1), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(conv3x3_winograd(x, u, b, addend), addend + F.conv2d(x, w, b, padding=1),
                               atol=1e-10, rtol=1e-10)


def test_weights_are_16_taps_of_g_w_gt_and_only_3x3_is_accepted():
    w = torch.zeros(2, 3, 3, 3, dtype=torch.float64)
    w[1, 2] = torch.arange(9, dtype=torch.float64).view(3, 3)
    u = winograd_weights(w, torch.float64)
    assert u.shape == (16, 2, 3) and not u[:, 0].any() and not u[:, 1, :2].any()
    assert u[0, 1, 2] == 0 and u[15, 1, 2] == 8  # corners: g[0, 0] and g[2, 2]
    assert u[5, 1, 2] == pytest.approx(sum(range(9)) / 4)  # tap (1, 1): every weight times 1/2 * 1/2
    with pytest.raises(ValueError, match="3x3"):
        winograd_weights(torch.zeros(2, 3, 1, 1), torch.float32)


def test_input_transform_of_one_tile_is_bt_d_b():
    d = torch.arange(16, dtype=torch.float64).view(1, 1, 4, 4)  # the tile of a 2x2 output is rows/cols -1..2
    bt = torch.tensor([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=torch.float64)
    window = F.pad(d[:, :, :2, :2], (1, 1, 1, 1))  # a 2x2 image: zero padding around it
    v = input_transform(d[:, :, :2, :2])
    torch.testing.assert_close(v.view(4, 4), bt @ window[0, 0] @ bt.T)


def test_without_a_kernel_the_module_is_nn_conv2d_plus_its_addend():
    torch.manual_seed(0)
    conv, plain = FusableConv3x3(6, 4, dtype=torch.float32), nn.Conv2d(6, 4, 3, padding=1)
    plain.load_state_dict(conv.state_dict())
    x, a = torch.randn(2, 6, 5, 5), torch.randn(2, 4, 5, 5)
    assert torch.equal(conv(x), plain(x))
    assert torch.equal(conv(x, a), a + plain(x))


class ReferenceWinogradGlue:
    """A glue whose ``conv3x3`` is the definition (``conv3x3_winograd``) for convolutions of at least
    ``min_channels`` in and out, as a platform's kernel would be chosen."""

    def __init__(self, min_channels: int):
        self.min_channels, self.prepared = min_channels, []

    def conv3x3_weights(self, w_OI33):
        if min(w_OI33.shape[:2]) < self.min_channels:
            return None
        self.prepared.append(tuple(w_OI33.shape))
        return winograd_weights(w_OI33, w_OI33.dtype)

    def conv3x3(self, x, u, bias, addend=None):
        return conv3x3_winograd(x, u, bias, addend)


def test_a_glue_without_the_pair_leaves_the_convolutions_to_torch():
    conv = FusableConv3x3(4, 4, dtype=torch.float32)
    assert use_conv3x3_kernel(object(), conv) == 0 and conv.kernel is None and conv.weight.shape == (4, 4, 3, 3)


def test_the_heads_take_the_kernel_where_the_glue_accepts_and_keep_their_outputs(golden_data):
    torch_model = build_golden_model(golden_data, select("cpu"))
    model = build_golden_model(golden_data, select("cpu"))
    convs = [m for head in (model.patch_embed, model.final_layer) for m in head.modules()
             if isinstance(m, FusableConv3x3)]
    C = model.cfg.latent_channels
    glue = ReferenceWinogradGlue(min_channels=C + 1)  # as on cuda: not the first (C in) nor the last (C out)
    taken = use_conv3x3_kernel(glue, model.patch_embed, model.final_layer)
    assert taken == len(convs) - 2 == len(glue.prepared) > 0
    for conv in convs:
        wide = min(conv.in_channels, conv.out_channels) > C
        assert (conv.kernel is not None) == wide and (conv.weight.numel() == 0) == wide
        assert not wide or conv.winograd.shape == (16, conv.out_channels, conv.in_channels)
    assert use_conv3x3_kernel(glue, model.patch_embed) == 0  # once: a prepared convolution is left as it is
    g = torch.Generator().manual_seed(0)
    latents, t = torch.randn(1, C, 5, 7, generator=g), torch.tensor([700.0])
    tokens, ref_tokens = model.image_tokens(latents, t), torch_model.image_tokens(latents, t)
    torch.testing.assert_close(tokens, ref_tokens, atol=1e-4, rtol=1e-4)
    h_BhwD = torch.randn(2, 35, model.cfg.hidden_size, generator=g)
    v, ref_v = model.velocity(h_BhwD, t.repeat(2), 5, 7), torch_model.velocity(h_BhwD, t.repeat(2), 5, 7)
    torch.testing.assert_close(v, ref_v, atol=1e-4, rtol=1e-4)
