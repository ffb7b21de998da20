"""Image input/output heads of HunyuanImage-3.0 (img_proj_type "unet", patch_size 1).

- ``TimestepEmbedder``: 256-dim sinusoid [cos, sin] of t (0..1000 scale),
  Linear, exact GELU, Linear. The model owns three (``timestep_emb``,
  ``time_embed``, ``time_embed_2``) and the Distil model two more.
- ``ResBlock``: ADM residual block with FiLM conditioning,
  ``GN(h) * (1 + scale) + shift`` with *scale the first half*.
- ``UNetDown`` (``patch_embed``): conv3 C -> hidden, ResBlock hidden -> D,
  flattened row-major into image tokens.
- ``UNetUp`` (``final_layer``): tokens -> [B, D, h, w], ResBlock D -> hidden,
  GN, SiLU, conv3 hidden -> C: the velocity.

Module names follow the official code so ``state_dict()`` keys match the
checkpoint. The Linear layers resolve the platform's kernel; the 3x3 convolutions
(``omni.winograd.FusableConv3x3``) and the GroupNorms (``omni.group_norm``) are torch's unless the
platform's glue offers ``conv3x3`` / ``group_norm`` (taken at ``finalize()``). A platform with the
``channels_last`` capability gets NHWC conv weights (``to_channels_last``), since the tokens
already are NHWC.

Shape suffixes: B batch, C channels, h/w latent rows/cols, D model width,
E embedding width.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from omni.group_norm import FusableGroupNorm, group_norm
from omni.layers import Linear
from omni.winograd import FusableConv3x3

FREQUENCY_DIM = 256
GN_GROUPS, GN_EPS = 32, 1e-5


def timestep_sinusoid(t_B: torch.Tensor, dim: int = FREQUENCY_DIM, max_period: float = 10000.0) -> torch.Tensor:
    """float32 ``[B, dim]`` = [cos(t f), sin(t f)], f_j = exp(-ln(max_period) j / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t_B.device) / half)
    args_BF = t_B.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args_BF), torch.sin(args_BF)], dim=-1)


class TimestepEmbedder(nn.Module):
    """t -> Linear(256, D), GELU, Linear(D, D)."""

    def __init__(self, hidden: int, *, platform, dtype: torch.dtype):
        super().__init__()
        self.mlp = nn.Sequential(Linear(FREQUENCY_DIM, hidden, platform=platform, dtype=dtype, bias=True),
                                 nn.GELU(),
                                 Linear(hidden, hidden, platform=platform, dtype=dtype, bias=True))
        self.dtype = dtype

    def forward(self, t_B: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_sinusoid(t_B).to(self.dtype))


class GroupNorm32(FusableGroupNorm):
    """GroupNorm(32, eps 1e-5) computed in fp32 and cast back (ADM's GroupNorm32)."""

    def __init__(self, channels: int, dtype: torch.dtype):
        super().__init__(GN_GROUPS, channels, eps=GN_EPS, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = group_norm(x.float(), self.num_groups, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)

    def silu(self, x: torch.Tensor, scale_BC: torch.Tensor | None = None,
             shift_BC: torch.Tensor | None = None) -> torch.Tensor:
        """``SiLU(GN(x) * (1 + scale) + shift)`` in x's dtype (the norm in fp32, as ``forward``): the platform's
        one pass, or ``group_norm_act``'s torch ops."""
        return self.fused(x, norm_dtype=x.dtype, out_dtype=x.dtype, silu=True, scale_BC=scale_BC, shift_BC=shift_BC)


def conv3(c_in: int, c_out: int, dtype: torch.dtype) -> FusableConv3x3:
    return FusableConv3x3(c_in, c_out, dtype=dtype)


class ResBlock(nn.Module):
    """ADM ResBlock with scale-shift norm: ``skip(x) + conv(SiLU(FiLM(GN(conv(SiLU(GN(x)))))))``."""

    def __init__(self, c_in: int, c_out: int, emb: int, *, platform, dtype: torch.dtype):
        super().__init__()
        self.in_layers = nn.Sequential(GroupNorm32(c_in, dtype), nn.SiLU(), conv3(c_in, c_out, dtype))
        self.emb_layers = nn.Sequential(nn.SiLU(), Linear(emb, 2 * c_out, platform=platform, dtype=dtype, bias=True))
        # index 2 is the (inference-time no-op) dropout, kept so the conv stays at out_layers.3
        self.out_layers = nn.Sequential(GroupNorm32(c_out, dtype), nn.SiLU(), nn.Identity(), conv3(c_out, c_out, dtype))
        self.skip_connection = nn.Conv2d(c_in, c_out, 1, dtype=dtype) if c_in != c_out else nn.Identity()

    def forward(self, x_BCHW: torch.Tensor, emb_BE: torch.Tensor) -> torch.Tensor:
        norm_in, _, conv_in = self.in_layers
        h = conv_in(norm_in.silu(x_BCHW))
        scale_BC, shift_BC = self.emb_layers(emb_BE).to(h.dtype).chunk(2, dim=-1)
        norm_out, conv_out = self.out_layers[0], self.out_layers[3]
        return conv_out(norm_out.silu(h, scale_BC, shift_BC), self.skip_connection(x_BCHW))  # skip + conv


def _require_patch_size_1(patch_size: int) -> None:
    if patch_size != 1:
        raise ValueError(f"patch_size {patch_size} is not supported: only the released patch_size 1 "
                         "(no down/up-sampling ResBlocks) is implemented")


class UNetDown(nn.Module):
    """``patch_embed``: latents ``[B, C, h, w]`` -> image tokens ``[B, h*w, D]`` (row-major)."""

    def __init__(self, latent_channels: int, hidden: int, dim: int, *, patch_size: int, platform,
                 dtype: torch.dtype):
        super().__init__()
        _require_patch_size_1(patch_size)
        self.model = nn.ModuleList([conv3(latent_channels, hidden, dtype),
                                    ResBlock(hidden, dim, dim, platform=platform, dtype=dtype)])

    def forward(self, latents_BChw: torch.Tensor, emb_BD: torch.Tensor) -> torch.Tensor:
        conv_in, resblock = self.model
        x_BDhw = resblock(conv_in(latents_BChw), emb_BD)
        return x_BDhw.flatten(2).transpose(1, 2)


def to_channels_last(*modules: nn.Module) -> None:
    """Channels-last weights for every convolution of ``modules`` (NHWC 2-D, NDHWC 3-D: the VAE's decoder).

    Image tokens are already ``[B, h, w, D]``, so the heads' activations are
    channels-last views; with NCHW weights cuDNN converts the layout around
    every convolution (1.26 ms of a 1024x1024 CFG step on an H200: BENCHMARKS.md, "Seventh session").
    """
    formats = {nn.Conv2d: torch.channels_last, nn.Conv3d: torch.channels_last_3d}
    for module in modules:
        for conv in module.modules():
            fmt = next((f for cls, f in formats.items() if isinstance(conv, cls)), None)
            if fmt is not None and conv.weight.dim() > 3:  # not a weight released for Winograd (empty)
                conv.weight.data = conv.weight.data.contiguous(memory_format=fmt)


class UNetUp(nn.Module):
    """``final_layer``: image-token hidden states ``[B, h*w, D]`` -> velocity ``[B, C, h, w]``."""

    def __init__(self, dim: int, hidden: int, latent_channels: int, *, patch_size: int, platform,
                 dtype: torch.dtype):
        super().__init__()
        _require_patch_size_1(patch_size)
        head = nn.Sequential(GroupNorm32(hidden, dtype), nn.SiLU(), conv3(hidden, latent_channels, dtype))
        self.model = nn.ModuleList([ResBlock(dim, hidden, dim, platform=platform, dtype=dtype), head])

    def forward(self, x_BhwD: torch.Tensor, emb_BD: torch.Tensor, h: int, w: int) -> torch.Tensor:
        resblock, head = self.model
        # The rows arrive as slices of the packed step (each row's timestep token lies between them): one copy
        # makes them one channels-last tensor, which the convolutions and the GroupNorm then read in place (with
        # the gaps they made copies of their own; BENCHMARKS.md, "Eleventh session")
        x_BhwD = x_BhwD.contiguous()
        x_BDhw = x_BhwD.transpose(1, 2).reshape(x_BhwD.shape[0], -1, h, w)  # a view: channels-last strides
        norm, _, conv = head
        return conv(norm.silu(resblock(x_BDhw, emb_BD))).contiguous()  # the sampler's NCHW latents (C is only 32)
