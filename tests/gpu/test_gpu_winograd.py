"""The image heads at the released widths on cuda: which 3x3 convolutions take the glue's Winograd kernel, and
what it does to one step's tokens and velocity (against the same heads with cuDNN's convolutions), eager and
replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from omni.group_norm import use_group_norm_kernel
from omni.models.hunyuan_image3 import image_io
from omni.models.hunyuan_image3.config import HunyuanImage3Config
from omni.specs import GlueSpec
from omni.winograd import FusableConv3x3, use_conv3x3_kernel

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]


def released_heads(platform, winograd: bool):
    """``patch_embed`` and ``final_layer`` at the released widths, seeded values, as ``finalize()`` leaves them."""
    cfg = HunyuanImage3Config()
    kw = dict(patch_size=1, platform=platform, dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda"):
        down = image_io.UNetDown(cfg.latent_channels, cfg.patch_embed_hidden_dim, cfg.hidden_size, **kw)
        up = image_io.UNetUp(cfg.hidden_size, cfg.patch_embed_hidden_dim, cfg.latent_channels, **kw)
    for name, p in (*down.named_parameters(), *up.named_parameters()):
        if p.dim() > 1:  # convolutions and linears: unit-variance outputs
            p.data.normal_(0, p[0].numel() ** -0.5)
        elif name.endswith("weight"):  # GroupNorm
            p.data.fill_(1.0)
        else:
            p.data.normal_(0, 0.02)
    glue = platform.glue(GlueSpec(hidden=cfg.hidden_size, head_dim=128, eps=1e-5, dtype=torch.bfloat16))
    image_io.to_channels_last(down, up)
    use_group_norm_kernel(glue.group_norm, down, up)
    taken = use_conv3x3_kernel(glue, down, up) if winograd else 0
    return cfg, down, up, taken


def test_the_wide_convolutions_take_winograd_and_the_narrow_keep_cudnn(platform):
    _, down, up, taken = released_heads(platform, winograd=True)
    kinds = {(m.in_channels, m.out_channels): m.kernel is not None
             for head in (down, up) for m in head.modules() if isinstance(m, FusableConv3x3)}
    assert kinds == {(32, 1024): False, (1024, 4096): True, (4096, 4096): True, (4096, 1024): True,
                     (1024, 1024): False, (1024, 32): False}
    assert taken == 3


def test_one_steps_heads_agree_with_cudnn_eager_and_captured(platform):
    cfg, down, up, _ = released_heads(platform, winograd=True)
    _, down_ref, up_ref, _ = released_heads(platform, winograd=False)
    g = torch.Generator(device="cuda").manual_seed(1)
    lat = torch.randn(1, cfg.latent_channels, 64, 64, device="cuda", generator=g).bfloat16()
    emb1, emb2 = (torch.randn(n, cfg.hidden_size, device="cuda", generator=g).bfloat16() for n in (1, 2))
    h = torch.randn(2, 64 * 64, cfg.hidden_size, device="cuda", generator=g).bfloat16()

    def step(d, u):
        return d(lat, emb1), u(h, emb2, 64, 64)

    with torch.inference_mode():
        tokens, velocity = step(down, up)
        ref_tokens, ref_velocity = step(down_ref, up_ref)
        for y, ref in ((tokens, ref_tokens), (velocity, ref_velocity)):
            rel = float((y.double() - ref.double()).norm() / ref.double().norm())
            assert rel < 0.01, f"relative L2 {rel:.2e} from the cuDNN heads"  # measured 0.0046 (bench_winograd)
        graph = torch.cuda.CUDAGraph()
        step(down, up)
        with torch.cuda.graph(graph):
            out = step(down, up)
        graph.replay()
        assert torch.equal(out[0], tokens) and torch.equal(out[1], velocity)


@pytest.mark.parametrize("launch", [(32, 64, 8), (16, 64, 4), (16, 32, 4)])
def test_each_launch_shape_of_the_transforms_gives_the_shipped_ones_bits(launch):
    """The launch shapes ``bench_winograd.py --launches`` times against the shipped one: a program's tiles,
    channels and warps change which thread computes an element, not its arithmetic."""
    from omni.platforms.cuda import winograd_triton as wt
    from omni.winograd import winograd_weights

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 1024, 64, 64, device="cuda", generator=g).bfloat16().contiguous(
        memory_format=torch.channels_last)
    w = (torch.randn(4096, 1024, 3, 3, device="cuda", generator=g) / 96).bfloat16()
    b = torch.randn(4096, device="cuda", generator=g).bfloat16()
    add = torch.randn(2, 4096, 64, 64, device="cuda", generator=g).bfloat16()  # the ResBlock's skip
    u = winograd_weights(w, torch.bfloat16)
    other = wt.Launch(*launch)
    assert other != wt.LAUNCH
    assert torch.equal(wt.input_transform(x, other), wt.input_transform(x))
    assert torch.equal(wt.conv3x3(x, u, b, add, launch=other), wt.conv3x3(x, u, b, add))
