"""VAE decode replayed from CUDA graphs (graph.mode: capture) equals eager decode, untiled and tiled."""
from __future__ import annotations

import pytest
import torch

from omni.step_graphs import StepGraphs
from omni.vae_tiling import tiled_decode
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]


def small_vae() -> AutoencoderKLConv3D:
    """A 16x VAE small enough for the tests (4 latent channels, 2 frames), seeded, on the device."""
    torch.manual_seed(0)
    cfg = VAEConfig(block_out_channels=(32, 32, 64, 64, 64), latent_channels=4, layers_per_block=1,
                    ffactor_spatial=16, ffactor_temporal=2)
    return AutoencoderKLConv3D(cfg).cuda().eval()


def test_captured_vae_decode_matches_eager():
    from omni.platform_manager import select

    platform = select("cuda")
    platform.device_services(0)
    vae = small_vae()
    eager = lambda z: vae.decode_image(z, dtype=torch.bfloat16)  # noqa: E731
    graphs = StepGraphs(platform, "cuda", name="vae_decode")
    captured = lambda z: graphs.run(((tuple(z.shape),), ()), z, eager, lambda: ())  # noqa: E731
    for seed in (1, 2):  # the second call replays with new latents
        z = torch.randn(1, 4, 32, 48, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        torch.testing.assert_close(captured(z).clone(), eager(z), atol=1e-5, rtol=0)
        tiles = tiled_decode(captured, z, tile=16, overlap=4, factor=16)
        torch.testing.assert_close(tiles, tiled_decode(eager, z, tile=16, overlap=4, factor=16), atol=1e-5, rtol=0)
    assert graphs.captures >= 2 and graphs.replays > graphs.captures


def test_tiles_on_two_streams_match_one_stream_eager_and_replayed():
    """Lanes decode tiles concurrently; blending waits per tile, and each lane replays its own graph."""
    from omni.platform_manager import select
    from omni.vae_tiling import TileLanes

    platform = select("cuda")
    services = platform.device_services(0)
    vae = small_vae()
    eager = lambda z: vae.decode_image(z, dtype=torch.bfloat16)  # noqa: E731
    lanes = TileLanes(services, count=2)
    assert len(lanes.streams) == 2
    graphs = StepGraphs(platform, "cuda", name="vae_decode", max_graphs=4)
    captured = lambda z: graphs.run(((tuple(z.shape), lanes.current), ()), z, eager, lambda: ())  # noqa: E731
    for seed in (1, 2, 3):
        z = torch.randn(1, 4, 40, 48, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        serial = tiled_decode(eager, z, tile=16, overlap=4, factor=16)
        torch.testing.assert_close(tiled_decode(eager, z, tile=16, overlap=4, factor=16, lanes=lanes), serial,
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(tiled_decode(captured, z, tile=16, overlap=4, factor=16, lanes=lanes), serial,
                                   atol=1e-5, rtol=0)
    assert graphs.captures >= 2 and {sig[1] for sig in graphs._graphs} == {0, 1}


def test_fp32_decode_takes_the_parallel_group_norm_and_captures(monkeypatch):
    """fp32 decode on the device: omni.group_norm's parallel form vs torch's kernel, eager and replayed."""
    import torch.nn.functional as F

    from omni import group_norm as gn
    from omni.platform_manager import select

    platform = select("cuda")
    platform.device_services(0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # compare the norms, not TF32 convolutions
    vae = small_vae()
    z = torch.randn(1, 4, 32, 48, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    x = torch.randn(1, 64, 2, 40, 40, device="cuda")
    assert torch.equal(gn.group_norm(x, 32, None, None, 1e-6), gn.parallel_group_norm(x, 32, None, None, 1e-6))
    with torch.inference_mode():
        ours = vae.decode_image(z)
        with monkeypatch.context() as m:
            m.setattr(gn, "group_norm", F.group_norm)
            reference = vae.decode_image(z)
        graphs = StepGraphs(platform, "cuda", name="vae_decode_fp32")
        replayed = graphs.run(((tuple(z.shape),), ()), z, vae.decode_image, lambda: ()).clone()
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(replayed, ours, atol=1e-5, rtol=0)


def test_fp16_autocast_decode_runs_the_float32_policy_in_parallel_and_captures(monkeypatch):
    """The official pipeline's fp16 autocast: GroupNorm stays fp32 (CUDA's policy) but takes the parallel
    statistics; the decode equals the one with torch's GroupNorm kernel, eager and replayed."""
    import torch.nn.functional as F

    from omni import group_norm as gn
    from omni.platform_manager import select

    platform = select("cuda")
    platform.device_services(0)
    vae = small_vae()
    z = torch.randn(1, 4, 32, 48, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    x = torch.randn(1, 64, 2, 40, 40, device="cuda", dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        assert gn.autocast_dtype_of_group_norm(x) == torch.float32
    parallel = gn.parallel_group_norm
    calls = []
    with torch.inference_mode():
        with monkeypatch.context() as m:  # count the parallel form's calls: the fp32 policy must take it
            m.setattr(gn, "parallel_group_norm", lambda *a: calls.append(a[0].dtype) or parallel(*a))
            ours = vae.decode_image(z, dtype=torch.float16)
        assert calls and set(calls) == {torch.float32}, calls
        with monkeypatch.context() as m:
            m.setattr(gn.GroupNorm, "forward", lambda self, t: F.group_norm(t, self.num_groups, self.weight,
                                                                            self.bias, self.eps))
            reference = vae.decode_image(z, dtype=torch.float16)
        graphs = StepGraphs(platform, "cuda", name="vae_decode_fp16")
        replayed = graphs.run(((tuple(z.shape),), ()), z, lambda t: vae.decode_image(t, dtype=torch.float16),
                              lambda: ()).clone()
    assert ours.isfinite().all()
    torch.testing.assert_close(ours, reference, atol=4e-3, rtol=0)  # fp16 convolutions after either norm
    torch.testing.assert_close(replayed, ours, atol=1e-5, rtol=0)


def test_nhwc_image_heads_on_cuda_match_nchw():
    """The cuda platform has the channels_last capability; bf16 heads with NHWC weights give the NCHW result."""
    import copy

    from omni.platform_manager import select
    from omni.models.hunyuan_image3.image_io import UNetDown, UNetUp, to_channels_last

    platform = select("cuda")
    platform.device_services(0)
    assert "channels_last" in platform.info.capabilities
    torch.manual_seed(0)
    kw = dict(patch_size=1, platform=platform, dtype=torch.bfloat16)
    with torch.device("cuda"):
        down, up = UNetDown(32, 256, 512, **kw).eval(), UNetUp(512, 256, 32, **kw).eval()
    for m in (down, up):
        for p in m.parameters():
            p.data.normal_(0, 0.05)
    down_cl, up_cl = copy.deepcopy(down), copy.deepcopy(up)
    to_channels_last(down_cl, up_cl)
    g = torch.Generator("cuda").manual_seed(5)
    z = torch.randn(1, 32, 24, 40, device="cuda", generator=g, dtype=torch.bfloat16)
    emb = torch.randn(2, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    with torch.inference_mode():
        tokens, tokens_cl = down(z, emb[:1]), down_cl(z, emb[:1])
        h = torch.randn(2, 24 * 40, 512, device="cuda", generator=g, dtype=torch.bfloat16)
        v, v_cl = up(h, emb, 24, 40), up_cl(h, emb, 24, 40)
    scale = float(tokens.float().abs().max())
    torch.testing.assert_close(tokens_cl.float(), tokens.float(), atol=2e-2 * scale, rtol=0)
    torch.testing.assert_close(v_cl.float(), v.float(), atol=2e-2 * float(v.float().abs().max()), rtol=0)
    assert v_cl.is_contiguous()


def test_a_prepared_vae_decodes_the_plain_pixels_and_captures():
    """``prepare`` on cuda (channels-last decoder, the glue's one-pass GroupNorm + SiLU): the fp16 decode's
    pixels are the plain decode's within one uint8 level (1.2% of this small random VAE's pixels were one
    level off on an H200), eager and replayed from a graph."""
    from omni.platform_manager import select
    from omni.specs import GlueSpec

    platform = select("cuda")
    platform.device_services(0)
    kernel = platform.glue(GlueSpec(hidden=64, head_dim=16, eps=1e-5, dtype=torch.bfloat16)).group_norm
    plain, prepared = small_vae(), small_vae()
    prepared.prepare(channels_last=True, group_norm_kernel=kernel)
    assert prepared.decoder.channels_last
    z = torch.randn(1, 4, 32, 48, device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    levels = lambda x: ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round()  # noqa: E731
    with torch.inference_mode():
        want = levels(plain.decode_image(z, dtype=torch.float16))
        eager = lambda z: prepared.decode_image(z, dtype=torch.float16)  # noqa: E731
        graphs = StepGraphs(platform, "cuda", name="vae_decode")
        for _ in range(2):  # capture, then replay
            got = levels(graphs.run(((tuple(z.shape),), ()), z, eager, lambda: ()).clone())
            assert (got - want).abs().max() <= 1 and (got != want).float().mean() < 0.05
        assert torch.equal(got, levels(eager(z)))
    assert graphs.captures == 1 and graphs.replays >= 1
