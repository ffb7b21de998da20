"""2-D rotary position embedding of HunyuanImage-3.0 (kexue.fm/archives/10352).

Every token carries an integer pair (y, x). Text and special tokens at
sequence index i get (i, i), which reduces to ordinary 1-D RoPE. An image of
h x w tokens starting at index L is a grid centred in the 1-D span
[L, L + h*w): token (r, c) gets (L + (h*w - h)/2 + r, L + (h*w - w)/2 + c),
truncated toward zero.

Frequencies f_j = theta^(-2j/H) for j < H/2; even slots j rotate with y and
odd slots with x (interleaved, not split in halves). The angle vector [H/2] is
duplicated to [H] and applied with the rotate_half convention, so dims i and
i + H/2 form a pair.

Shape suffixes: T tokens (any packed list, not necessarily arange), N heads,
H head dim, F = H/2 frequencies.
"""
from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """f_j = theta^(-2j/H), float32 ``[F]`` (computed as the official code does)."""
    exponent_F = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta ** exponent_F)


def rope_cos_sin(pos_yx_T2: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos_TH, sin_TH)`` tables for integer (y, x) positions ``[T, 2]``."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {head_dim}")
    inv_freq_F = inverse_frequencies(head_dim, theta, pos_yx_T2.device)
    axis_F = torch.arange(head_dim // 2, device=pos_yx_T2.device) % 2  # 0 = y, 1 = x
    angle_TF = pos_yx_T2[:, axis_F].float() * inv_freq_F
    angle_TH = torch.cat([angle_TF, angle_TF], dim=-1)
    return angle_TH.cos(), angle_TH.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_TNH: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor) -> torch.Tensor:
    """Rotate ``[T, N, H]`` queries or keys; computed in fp32, returned in ``x``'s dtype."""
    x = x_TNH.float()
    out = x * cos_TH[:, None, :] + rotate_half(x) * sin_TH[:, None, :]
    return out.to(x_TNH.dtype)


def text_positions(start: int, length: int, device=None) -> torch.Tensor:
    """(i, i) pairs ``[length, 2]`` for sequence indices start .. start+length-1."""
    i_T = torch.arange(start, start + length, device=device)
    return torch.stack([i_T, i_T], dim=-1)


def image_positions(start: int, h: int, w: int, device=None) -> torch.Tensor:
    """Row-major (y, x) pairs ``[h*w, 2]`` of an h x w image whose first token is at index ``start``.

    Integer form of floor(L + (h*w - h)/2 + r) (all terms are non-negative,
    so truncation is floor).
    """
    r = torch.arange(h, device=device)
    c = torch.arange(w, device=device)
    y_h = start + (h * w - h + 2 * r) // 2
    x_w = start + (h * w - w + 2 * c) // 2
    return torch.stack(torch.meshgrid(y_h, x_w, indexing="ij"), dim=-1).reshape(h * w, 2)
