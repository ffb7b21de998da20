"""HunyuanImage-3.0 VAE ("hunyuan-image-vae-v1", official class AutoencoderKLConv3D).

A KL autoencoder built from 3-D convolutions. Images travel through it as
short clips: ``encode`` repeats a still frame ``ffactor_temporal`` times,
and the decoder turns one latent frame back into ``ffactor_temporal``
frames, of which the image pipeline keeps the last.

The resampling steps follow DC-AE. Every down or up step is a convolution
plus a pixel (un)shuffle, and a parameter-free shortcut runs beside it. Going
down, the shortcut averages groups of channels; going up, it repeats channels.
The encoder's ``conv_out`` and the decoder's ``conv_in`` get the same kind of
shortcut. All convolutions are zero-padded and symmetric in T (not causal).

On a platform with the ``channels_last`` capability the decoder runs channels-last
(``Decoder.use_channels_last``), and its "GroupNorm, swish" pairs run as the
platform's one-pass kernel where it has one (``omni.group_norm.use_group_norm_kernel``).

Module and parameter names follow the official code, so ``state_dict()`` keys
equal the checkpoint's ``vae.*`` keys without the ``vae.`` prefix.
The blocks (convolutions, resamplers, ResNet and attention blocks, levels) are in
``vae_blocks.py``; this file holds the config, the encoder, the decoder and the autoencoder.

Shape suffixes: B batch, C channels, T frames, H/W pixel rows/cols,
h/w latent rows/cols, N flattened positions (T*h*w).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
from torch import nn

from omni.group_norm import use_group_norm_kernel

from .image_io import to_channels_last
from .vae_blocks import DownsampleDCAE, Level, MidBlock, UpsampleDCAE, chain, conv3, repeat_channels, vae_group_norm

LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0
_IGNORED_KEYS = ("_class_name", "_diffusers_version", "sample_size", "sample_tsize")
_MUST_BE_TRUE = ("downsample_match_channel", "upsample_match_channel")


@dataclass(frozen=True)
class VAEConfig:
    """Hyper-parameters of the VAE. The defaults are the released ones."""

    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    layers_per_block: int = 2
    ffactor_spatial: int = 16
    ffactor_temporal: int = 4
    scaling_factor: float = 0.562679178327931
    only_encoder: bool = False  # Instruct conditioning: build the encoder alone (no decoder)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_out_channels", tuple(self.block_out_channels))
        n_spatial, n_temporal = _log2(self.ffactor_spatial), _log2(self.ffactor_temporal)
        if n_temporal > n_spatial or n_spatial >= len(self.block_out_channels):
            raise ValueError(f"factors {self.ffactor_spatial}/{self.ffactor_temporal} do not fit "
                             f"{len(self.block_out_channels)} levels")
        if self.block_out_channels[-1] % (2 * self.latent_channels):
            raise ValueError("block_out_channels[-1] must be a multiple of 2*latent_channels")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VAEConfig":
        """Build from the ``vae`` dict of a checkpoint's config.json.

        Tiling sizes are ignored because tiling is off in the official pipeline.
        The ``*_match_channel`` flags must be true, since those are the only
        checkpoints that exist. A null ``shift_factor`` is accepted, because
        the pipeline applies no shift. Any other unknown key is an error, so
        that a config this code does not understand is never half-loaded.
        """
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in d.items():
            if key in known:
                kwargs[key] = value
            elif key in _MUST_BE_TRUE:
                if value is not True:
                    raise ValueError(f"VAE config: {key}={value!r} is not supported (must be true)")
            elif key == "shift_factor":
                if value is not None:
                    raise ValueError(f"VAE config: shift_factor={value!r} is not supported")
            elif key not in _IGNORED_KEYS:
                raise ValueError(f"VAE config: unknown key {key!r}")
        return cls(**kwargs)


def _log2(n: int) -> int:
    if n < 1 or n & (n - 1):
        raise ValueError(f"factor {n} is not a power of two")
    return n.bit_length() - 1


class Encoder(nn.Module):
    """Image clip [B, 3, T, H, W] to posterior moments [B, 2*latent, T/ft, H/fs, W/fs]."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chs = cfg.block_out_channels
        n_spatial, n_temporal = _log2(cfg.ffactor_spatial), _log2(cfg.ffactor_temporal)
        self.conv_in = conv3(cfg.in_channels, chs[0])
        self.down = nn.ModuleList()
        c = chs[0]
        for i, ch in enumerate(chs):
            spatial = i < n_spatial
            # T is halved only in the last n_temporal of the spatial levels.
            temporal = spatial and i >= n_spatial - n_temporal
            down = DownsampleDCAE(ch, chs[i + 1], temporal) if spatial else None
            self.down.append(Level(chain(c, ch, cfg.layers_per_block), down, "downsample"))
            c = chs[i + 1] if spatial else ch
        self.mid = MidBlock(c)
        self.norm_out = vae_group_norm(c)
        self.conv_out = conv3(c, 2 * cfg.latent_channels)
        self.out_group = c // (2 * cfg.latent_channels)

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x_BCTHW)
        for level in self.down:
            h = level(h)
        h = self.mid(h)
        B, C, T, H, W = h.shape
        skip = h.view(B, C // self.out_group, self.out_group, T, H, W).mean(dim=2)
        return self.conv_out(self.norm_out.silu(h)) + skip


class Decoder(nn.Module):
    """Latents [B, latent, T, h, w] to a clip [B, 3, T*ft, h*fs, w*fs]."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        chs = tuple(reversed(cfg.block_out_channels))
        n_spatial, n_temporal = _log2(cfg.ffactor_spatial), _log2(cfg.ffactor_temporal)
        self.conv_in = conv3(cfg.latent_channels, chs[0])
        self.in_repeats = chs[0] // cfg.latent_channels
        self.mid = MidBlock(chs[0])
        self.up = nn.ModuleList()
        c = chs[0]
        for i, ch in enumerate(chs):
            spatial = i < n_spatial
            # T is doubled only in the first n_temporal levels (mirroring the encoder).
            up = UpsampleDCAE(ch, chs[i + 1], i < n_temporal) if spatial else None
            self.up.append(Level(chain(c, ch, cfg.layers_per_block + 1), up, "upsample"))
            c = chs[i + 1] if spatial else ch
        self.norm_out = vae_group_norm(c)
        self.conv_out = conv3(c, cfg.out_channels)
        self.channels_last = False  # NTHWC activations and conv weights (``use_channels_last``)

    def use_channels_last(self) -> None:
        """Keep every conv weight, and so every activation, channels-last (``torch.channels_last_3d``).

        cuDNN's 3-D convolutions compute in NDHWC: with NCDHW tensors it converts the layout around each one
        (27.7 of the 280 ms of a 1024x1024 fp16 decode on an H200, BENCHMARKS.md "Seventh session").
        The values are the same; only the memory order changes.
        """
        to_channels_last(self)
        self.channels_last = True

    def forward(self, z_BCThw: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            z_BCThw = z_BCThw.contiguous(memory_format=torch.channels_last_3d)
        h = self.conv_in(z_BCThw) + repeat_channels(z_BCThw, self.in_repeats)
        h = self.mid(h)
        for level in self.up:
            h = level(h)
        return self.conv_out(self.norm_out.silu(h))


class AutoencoderKLConv3D(nn.Module):
    """The HunyuanImage-3.0 VAE. It holds ``encoder`` and ``decoder``; tiling and slicing are left out.

    ``with_encoder=False`` builds the decoder alone: text-to-image only decodes,
    and the released encoder is 389M parameters (1.45 GiB in float32).
    ``cfg.only_encoder`` builds the encoder alone (conditioning images only).
    """

    def __init__(self, cfg: VAEConfig, *, with_encoder: bool = True):
        super().__init__()
        if cfg.only_encoder and not with_encoder:
            raise ValueError("only_encoder=True with with_encoder=False leaves nothing to build")
        self.cfg = cfg
        self.encoder = Encoder(cfg) if with_encoder else None
        self.decoder = None if cfg.only_encoder else Decoder(cfg)

    def prepare(self, *, channels_last: bool, group_norm_kernel=None) -> None:
        """Once, after loading: a channels-last decoder (the platform's ``channels_last`` capability) and the
        platform's one-pass GroupNorm + SiLU (its glue's ``group_norm``) in every block, where they exist."""
        if channels_last and self.decoder is not None:
            self.decoder.use_channels_last()
        if group_norm_kernel is not None:
            use_group_norm_kernel(group_norm_kernel, self)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the posterior ``(mean, logvar)``, with logvar clamped to [-30, 20].

        An image [B, C, H, W], or a clip with T=1, is expanded to
        ``ffactor_temporal`` identical frames first, because the encoder only
        sees whole temporal groups. For an image input the latent T (which is 1) is squeezed
        away. A longer clip must have T divisible by ``ffactor_temporal``.
        """
        if self.encoder is None:
            raise RuntimeError("this VAE was built without its encoder (with_encoder=False: text-to-image only)")
        is_image = x.ndim == 4
        x_BCTHW = x.unsqueeze(2) if is_image else x
        ft = self.cfg.ffactor_temporal
        if x_BCTHW.shape[2] == 1:
            x_BCTHW = x_BCTHW.expand(-1, -1, ft, -1, -1)
        elif x_BCTHW.shape[2] % ft:
            raise ValueError(f"clip length {x_BCTHW.shape[2]} is not a multiple of {ft}")
        mean, logvar = self.encoder(x_BCTHW).chunk(2, dim=1)
        logvar = logvar.clamp(LOGVAR_MIN, LOGVAR_MAX)
        return (mean.squeeze(2), logvar.squeeze(2)) if is_image else (mean, logvar)

    def decode(self, z_BCThw: torch.Tensor) -> torch.Tensor:
        """Run the raw decoder: [B, C, T, h, w] to [B, 3, T*ft, H, W], keeping every frame."""
        if self.decoder is None:
            raise RuntimeError("this VAE was built without its decoder (only_encoder=True)")
        return self.decoder(z_BCThw)

    @torch.no_grad()
    def decode_image(self, latents_BChw: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Turn pipeline latents into pixels in about [-1, 1], following the official pipeline.

        The steps are: divide by scaling_factor, add T=1, decode, and keep the
        last of the ``ffactor_temporal`` output frames. With a ``dtype`` other
        than float32, the decoder runs under autocast, as the official fp16
        path does. GroupNorm and the scaling stay in float32. The result is
        returned as float32.
        """
        z_BCThw = (latents_BChw.float() / self.cfg.scaling_factor).unsqueeze(2)
        with _autocast(z_BCThw.device, dtype):
            x_BCTHW = self.decode(z_BCThw)
        return x_BCTHW[:, :, -1].float()

    @torch.no_grad()
    def encode_image(self, x_B3HW: torch.Tensor, sample: bool = False,
                     generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Turn an image in [-1, 1] into a latent scaled by scaling_factor.

        By default the posterior mean is used. ``sample=True`` draws
        mean + std*eps with ``generator``, which is what the official code does
        for conditioning images.
        """
        with _autocast(x_B3HW.device, dtype):
            mean, logvar = self.encode(x_B3HW)
        mean, logvar = mean.float(), logvar.float()
        z = mean + torch.exp(0.5 * logvar) * _randn_like(mean, generator) if sample else mean
        return z * self.cfg.scaling_factor


def _autocast(device: torch.device, dtype: torch.dtype):
    """Autocast to ``dtype``. For float32 autocast is disabled, so the model runs in its own weights' dtype."""
    return torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32)


def _randn_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw noise on the generator's device (as diffusers' randn_tensor does), then move it to ``x``."""
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, device=device, dtype=x.dtype).to(x.device)
