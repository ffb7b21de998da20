"""GroupNorm whose statistics reduce in parallel over each group: ``group_norm`` and the ``GroupNorm`` module.

torch's CUDA GroupNorm computes each (sample, group) row's moments in one
thread block, so one image with 32 groups keeps 32 blocks busy on a
132-SM GPU. At the VAE's 1024x1024 levels a group holds millions of
values: the moments took 158 of the 543 ms of a 1024x1024 decode on an
H200 (BENCHMARKS.md). ``torch.var_mean`` over ``[B, G, -1]`` spreads each
reduction over many blocks. The normalisation then runs as torch's kernel
does it: one fused pass ``y = x * a + b`` with per-channel
``a = weight * rstd`` and ``b = bias - mean * a``.

Accelerators take that path (``parallel_group_norm``); the CPU keeps torch's kernel (``group_norm``).
Same math as ``F.group_norm`` in the input's dtype (biased variance, eps
inside the square root); results agree to a few fp32 roundings. Under
autocast the module calls ``F.group_norm``, so autocast's per-device policy
for it (fp32 on CUDA) holds unchanged.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """``F.group_norm(x, num_groups, weight, bias, eps)`` for ``x`` ``[B, C, *]``.

    On the CPU it is ``F.group_norm`` itself: there one fused pass over rows
    already spread across the cores is faster (a 1024x1024 decode of the tiny
    VAE on 2 cores: 4.8 s against 5.6 s the parallel way).
    """
    if x.device.type == "cpu":
        return F.group_norm(x, num_groups, weight, bias, eps)
    return parallel_group_norm(x, num_groups, weight, bias, eps)


def parallel_group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                        eps: float) -> torch.Tensor:
    """The statistics by ``torch.var_mean`` over ``[B, G, -1]``, then one ``y = x * a + b`` pass (any device)."""
    B, C = x.shape[:2]
    var_BG1, mean_BG1 = torch.var_mean(x.reshape(B, num_groups, -1), dim=-1, keepdim=True, correction=0)
    rstd_BC = torch.rsqrt(var_BG1 + eps).expand(B, num_groups, C // num_groups).reshape(B, C)
    mean_BC = mean_BG1.expand(B, num_groups, C // num_groups).reshape(B, C)
    a_BC = rstd_BC if weight is None else rstd_BC * weight
    b_BC = -mean_BC * a_BC if bias is None else bias - mean_BC * a_BC
    per_channel = (B, C) + (1,) * (x.dim() - 2)
    return torch.addcmul(b_BC.view(per_channel), x, a_BC.view(per_channel))


class GroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` (same parameters and state-dict names) computed by ``group_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # autocast's own GroupNorm policy (fp32 on CUDA) decides
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
