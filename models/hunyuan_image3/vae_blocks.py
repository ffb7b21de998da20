"""The VAE's building blocks: 3-D convolutions, the DC-AE resamplers with their parameter-free shortcuts,
ResNet and attention blocks, one resolution level.

Module and parameter names follow the official code (``omni.models.hunyuan_image3.vae`` assembles them into
the encoder and the decoder). Shape suffixes as there: B batch, C channels, T frames, H/W pixel rows/cols,
h/w latent rows/cols, N flattened positions (T*h*w).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni.group_norm import GroupNorm, channels_last


def vae_group_norm(channels: int) -> nn.GroupNorm:
    return GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class Conv3x3x3(nn.Conv3d):
    """3x3x3 conv, zero-padded by 1; a single frame only meets the kernel's middle slice.

    With T == 1 the two outer temporal taps multiply padding zeros, so the
    result equals a 2-D conv with ``weight[:, :, 1]`` at a third of the cost.
    """

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        if x_BCTHW.shape[2] != 1:
            return super().forward(x_BCTHW)
        return F.conv2d(x_BCTHW[:, :, 0], self.weight[:, :, 1], self.bias, padding=1).unsqueeze(2)


def conv3(c_in: int, c_out: int) -> nn.Conv3d:
    return Conv3x3x3(c_in, c_out, kernel_size=3, stride=1, padding=1)


def conv1(c_in: int, c_out: int) -> nn.Conv3d:
    return nn.Conv3d(c_in, c_out, kernel_size=1)


def space_to_channels(x_BCTHW: torch.Tensor, rt: int) -> torch.Tensor:
    """Pixel-unshuffle by (rt, 2, 2). The output channels are ordered (rt, 2, 2, C), with C innermost."""
    B, C, T, H, W = x_BCTHW.shape
    x = x_BCTHW.view(B, C, T // rt, rt, H // 2, 2, W // 2, 2)
    x = x.permute(0, 3, 5, 7, 1, 2, 4, 6)
    return x.reshape(B, rt * 4 * C, T // rt, H // 2, W // 2)


def repeat_channels(x_BCTHW: torch.Tensor, repeats: int) -> torch.Tensor:
    """``x.repeat_interleave(repeats, dim=1)``, keeping a channels-last layout."""
    if not channels_last(x_BCTHW):
        return x_BCTHW.repeat_interleave(repeats, dim=1)
    return x_BCTHW.permute(0, 2, 3, 4, 1).repeat_interleave(repeats, dim=-1).permute(0, 4, 1, 2, 3)


def channels_to_space(x_BCThw: torch.Tensor, rt: int) -> torch.Tensor:
    """Inverse of :func:`space_to_channels`; a channels-last input gives a channels-last output (one copy)."""
    B, C4, T, h, w = x_BCThw.shape
    C = C4 // (rt * 4)
    if channels_last(x_BCThw):
        x = x_BCThw.permute(0, 2, 3, 4, 1).view(B, T, h, w, rt, 2, 2, C).permute(0, 1, 4, 2, 5, 3, 6, 7)
        return x.reshape(B, T * rt, h * 2, w * 2, C).permute(0, 4, 1, 2, 3)
    x = x_BCThw.view(B, rt, 2, 2, C, T, h, w)
    x = x.permute(0, 4, 5, 1, 6, 2, 7, 3)
    return x.reshape(B, C, T * rt, h * 2, w * 2)


class ResnetBlock(nn.Module):
    """GN, swish, conv, then GN, swish, conv again, plus a residual (a 1x1x1 conv only if the channel count changes)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1, self.conv1 = vae_group_norm(c_in), conv3(c_in, c_out)
        self.norm2, self.conv2 = vae_group_norm(c_out), conv3(c_out, c_out)
        self.nin_shortcut = conv1(c_in, c_out) if c_in != c_out else None

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.norm1.silu(x_BCTHW))
        h = self.conv2(self.norm2.silu(h))
        skip = x_BCTHW if self.nin_shortcut is None else self.nin_shortcut(x_BCTHW)
        return skip + h


class AttnBlock(nn.Module):
    """Single-head self-attention over every T*h*w position (the mid block only)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = vae_group_norm(channels)
        self.q, self.k, self.v = conv1(channels, channels), conv1(channels, channels), conv1(channels, channels)
        self.proj_out = conv1(channels, channels)

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        B, C, T, H, W = x_BCTHW.shape
        h = self.norm(x_BCTHW)
        q_B1NC, k_B1NC, v_B1NC = (m(h).flatten(2).transpose(1, 2).unsqueeze(1) for m in (self.q, self.k, self.v))
        o_B1NC = F.scaled_dot_product_attention(q_B1NC, k_B1NC, v_B1NC)
        o_BCTHW = o_B1NC.squeeze(1).transpose(1, 2).reshape(B, C, T, H, W)
        return x_BCTHW + self.proj_out(o_BCTHW)


class DownsampleDCAE(nn.Module):
    """Halve H and W (and T if ``temporal``), going from c_in to c_out channels.

    The conv produces c_out/factor channels, which the unshuffle turns into
    c_out. The shortcut unshuffles the input the same way and averages each
    run of consecutive channels down to c_out.
    """

    def __init__(self, c_in: int, c_out: int, temporal: bool):
        super().__init__()
        self.rt = 2 if temporal else 1
        factor = self.rt * 4
        if c_out % factor or (factor * c_in) % c_out:
            raise ValueError(f"DCAE downsample {c_in}->{c_out} does not divide by factor {factor}")
        self.conv = conv3(c_in, c_out // factor)
        self.group_size = factor * c_in // c_out

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        h = space_to_channels(self.conv(x_BCTHW), self.rt)
        skip = space_to_channels(x_BCTHW, self.rt)
        B, _, T, H, W = skip.shape
        skip = skip.view(B, h.shape[1], self.group_size, T, H, W).mean(dim=2)
        return h + skip


class UpsampleDCAE(nn.Module):
    """Double H and W (and T if ``temporal``), going from c_in to c_out channels.

    The conv produces c_out*factor channels, and the shuffle turns them into
    c_out. The shortcut repeat-interleaves the input channels up to
    c_out*factor and then shuffles them the same way.
    """

    def __init__(self, c_in: int, c_out: int, temporal: bool):
        super().__init__()
        self.rt = 2 if temporal else 1
        factor = self.rt * 4
        if (factor * c_out) % c_in:
            raise ValueError(f"DCAE upsample {c_in}->{c_out} does not divide by factor {factor}")
        self.conv = conv3(c_in, c_out * factor)
        self.repeats = factor * c_out // c_in

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        h = channels_to_space(self.conv(x_BCTHW), self.rt)
        skip = channels_to_space(repeat_channels(x_BCTHW, self.repeats), self.rt)
        return h + skip


class MidBlock(nn.Module):
    """ResNet block, attention, ResNet block, all at the bottleneck width."""

    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(x_BCTHW)))


class Level(nn.Module):
    """One resolution level: ResNet blocks, then an optional resampler.

    The resampler is registered as ``downsample`` or ``upsample`` so that the
    keys match the checkpoint.
    """

    def __init__(self, widths: list[tuple[int, int]], resampler: nn.Module | None, name: str):
        super().__init__()
        self.block = nn.ModuleList(ResnetBlock(c_in, c_out) for c_in, c_out in widths)
        self.resampler_name = name
        if resampler is not None:
            self.add_module(name, resampler)

    def forward(self, x_BCTHW: torch.Tensor) -> torch.Tensor:
        for blk in self.block:
            x_BCTHW = blk(x_BCTHW)
        resampler = getattr(self, self.resampler_name, None)
        return x_BCTHW if resampler is None else resampler(x_BCTHW)


def chain(c_in: int, c_out: int, n: int) -> list[tuple[int, int]]:
    """(in, out) widths of n blocks in a row: the first block goes c_in to c_out, the rest stay at c_out."""
    return [(c_in if i == 0 else c_out, c_out) for i in range(n)]
