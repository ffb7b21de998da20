"""Tiled VAE decode: coverage, closeness to untiled, and identical results when tiles are spread over ranks."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig
from omni.device import DeviceServices
from omni.vae_tiling import TileLanes, tile_grid, tiled_decode

CFG = VAEConfig(block_out_channels=(32, 32, 64), latent_channels=4, layers_per_block=1,
                ffactor_spatial=4, ffactor_temporal=2)


def tiny_vae() -> AutoencoderKLConv3D:
    torch.manual_seed(0)
    vae = AutoencoderKLConv3D(CFG).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.copy_(torch.randn_like(p) / max(p[0].numel(), 1) ** 0.5 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    return vae


@pytest.mark.parametrize("h, w, tile, overlap", [(16, 16, 8, 4), (20, 13, 8, 2), (5, 7, 8, 2)])
def test_tiles_cover_every_latent(h, w, tile, overlap):
    seen = torch.zeros(h, w, dtype=torch.int32)
    for t in tile_grid(h, w, tile, overlap):
        assert t.y1 - t.y0 <= tile and t.x1 - t.x0 <= tile
        seen[t.y0:t.y1, t.x0:t.x1] += 1
    assert (seen >= 1).all()


def test_tiled_decode_is_close_to_untiled():
    """Convolutions see the same context inside the overlap; only the global mid attention differs."""
    vae = tiny_vae()
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
    full = vae.decode_image(z)
    tiled = tiled_decode(vae.decode_image, z, tile=10, overlap=4, factor=4)
    assert tiled.shape == full.shape
    rel = ((tiled - full).norm() / full.norm()).item()
    assert rel < 0.15, f"relative L2 difference {rel:.3f}"
    one_tile = tiled_decode(vae.decode_image, z, tile=16, overlap=4, factor=4)
    torch.testing.assert_close(one_tile, full, atol=1e-6, rtol=0)  # one tile = untiled exactly


def _rank_main(rank: int, world: int, init: str, z: torch.Tensor, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        vae = tiny_vae()

        def all_reduce(t):
            dist.all_reduce(t)
            return t

        x = tiled_decode(vae.decode_image, z, tile=8, overlap=4, factor=4, rank=rank, world=world,
                         all_reduce=all_reduce)
        save_file({"x": x.contiguous()}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tiles_spread_over_two_ranks_match_one_process(tmp_path):
    z = torch.randn(1, 4, 12, 16, generator=torch.Generator().manual_seed(2))
    solo = tiled_decode(tiny_vae().decode_image, z, tile=8, overlap=4, factor=4)
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_rank_main, args=(2, init, z, str(tmp_path / "x")), nprocs=2, join=True, start_method="spawn")
    for r in range(2):
        got = load_file(f"{tmp_path / 'x'}.{r}")["x"]
        torch.testing.assert_close(got, solo, atol=1e-5, rtol=0)


def test_lanes_without_streams_decode_in_order_on_the_caller():
    """The CPU has no streams: lanes fall back to one tile after another, with the same image."""
    lanes = TileLanes(DeviceServices("cpu"), count=3)
    assert lanes.streams == []
    vae = tiny_vae()
    z = torch.randn(1, 4, 12, 16, generator=torch.Generator().manual_seed(3))
    seen = []

    def decode(t):
        seen.append(tuple(t.shape))
        return vae.decode_image(t)

    got = tiled_decode(decode, z, tile=8, overlap=4, factor=4, lanes=lanes)
    torch.testing.assert_close(got, tiled_decode(vae.decode_image, z, tile=8, overlap=4, factor=4), atol=0, rtol=0)
    assert len(seen) == len(tile_grid(12, 16, 8, 4))


def test_decoder_only_vae_decodes_the_same_and_refuses_to_encode():
    """Text-to-image builds the VAE without its encoder; decoding is unchanged."""
    full = tiny_vae()
    dec = AutoencoderKLConv3D(CFG, with_encoder=False).eval()
    dec.decoder.load_state_dict(full.decoder.state_dict())
    assert dec.encoder is None and sum(p.numel() for p in dec.parameters()) < sum(p.numel() for p in full.parameters())
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(dec.decode_image(z), full.decode_image(z), atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="without its encoder"):
        dec.encode(torch.zeros(1, 3, 32, 32))
