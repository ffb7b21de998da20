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
autocast the module follows autocast's policy for ``group_norm`` on that
device, read once by a probe: where the policy computes in float32 (CUDA's
list) it runs the parallel form on fp32 inputs and weights and returns fp32,
as the policy would (torch's own kernel took 0.16 s of moments per
1024x1024 decode); elsewhere it calls ``F.group_norm`` under autocast. A
channels-last input is reduced in place and the result keeps its layout.

``group_norm_act`` is the definition of the GroupNorm the image paths chain
with a FiLM modulation and SiLU (the image heads' ResBlocks, the VAE's
"GN, swish"): the optional glue method ``group_norm`` of a platform computes
exactly this in one pass over the activations (``omni_glue_impl``).
``FusableGroupNorm`` modules take that kernel at build (``use_group_norm_kernel``)
and keep these torch ops when the platform has none.
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
    """The statistics by ``torch.var_mean`` over each group, then one ``y = x * a + b`` pass (any device)."""
    B, C = x.shape[:2]
    var_BG, mean_BG = _group_moments(x, num_groups)
    rstd_BC = torch.rsqrt(var_BG + eps).repeat_interleave(C // num_groups, dim=1)
    mean_BC = mean_BG.repeat_interleave(C // num_groups, dim=1)
    a_BC = rstd_BC if weight is None else rstd_BC * weight
    b_BC = -mean_BC * a_BC if bias is None else bias - mean_BC * a_BC
    per_channel = (B, C) + (1,) * (x.dim() - 2)
    return torch.addcmul(b_BC.view(per_channel), x, a_BC.view(per_channel))


def _group_moments(x: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Biased variance and mean ``[B, G]`` per group; a channels-last ``x`` (4-D or 5-D) is read in place as
    ``[B, positions, G, C/G]``."""
    B, C = x.shape[:2]
    if channels_last(x):
        return torch.var_mean(x.movedim(1, -1).reshape(B, -1, G, C // G), dim=(1, 3), correction=0)
    return torch.var_mean(x.reshape(B, G, -1), dim=-1, correction=0)


def channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` lies in memory as ``[B, *positions, C]`` (``torch.channels_last`` for 4-D,
    ``channels_last_3d`` for 5-D) and not also as ``[B, C, *positions]``."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return fmt is not None and not x.is_contiguous() and x.is_contiguous(memory_format=fmt)


def group_norm_act(x: torch.Tensor, num_groups: int, weight: torch.Tensor, bias: torch.Tensor, eps: float, *,
                   norm_dtype: torch.dtype, out_dtype: torch.dtype, silu: bool = False,
                   scale_BC: torch.Tensor | None = None, shift_BC: torch.Tensor | None = None) -> torch.Tensor:
    """GroupNorm of ``x`` ``[B, C, *]`` in fp32, rounded to ``norm_dtype``, then in ``norm_dtype``
    ``y * (1 + scale) + shift`` (FiLM, ``[B, C]``, when given) and SiLU, then rounded to ``out_dtype``.

    Each torch op here rounds to ``norm_dtype``; a fused kernel must round at the same places (the image
    heads' bf16 chain is ADM's GroupNorm32 followed by bf16 ops; the VAE's fp32 chain under fp16 autocast is
    one rounding to fp16 where the next convolution casts its input).
    """
    y = group_norm(x.float(), num_groups, weight.float(), bias.float(), eps).to(norm_dtype)
    if scale_BC is not None:
        per_channel = scale_BC.shape + (1,) * (x.dim() - 2)
        y = y * (1 + scale_BC.to(norm_dtype).view(per_channel)) + shift_BC.to(norm_dtype).view(per_channel)
    return (F.silu(y) if silu else y).to(out_dtype)


class FusableGroupNorm(nn.GroupNorm):
    """An ``nn.GroupNorm`` whose "norm [, FiLM], SiLU" chain may run as the platform's fused kernel.

    ``kernel`` is the glue's ``group_norm`` (same arguments and result as ``group_norm_act``), set once at
    build by ``use_group_norm_kernel``; without it ``fused`` computes ``group_norm_act`` with torch ops.
    """

    kernel = None

    def fused(self, x: torch.Tensor, *, norm_dtype: torch.dtype, out_dtype: torch.dtype, silu: bool,
              scale_BC: torch.Tensor | None = None, shift_BC: torch.Tensor | None = None) -> torch.Tensor:
        return (self.kernel or group_norm_act)(x, self.num_groups, self.weight, self.bias, self.eps,
                                               norm_dtype=norm_dtype, out_dtype=out_dtype, silu=silu,
                                               scale_BC=scale_BC, shift_BC=shift_BC)


def use_group_norm_kernel(kernel, *modules: nn.Module) -> int:
    """Give every ``FusableGroupNorm`` inside ``modules`` the platform's fused ``kernel``; returns how many."""
    norms = [m for module in modules for m in module.modules() if isinstance(m, FusableGroupNorm)]
    for m in norms:
        m.kernel = kernel
    return len(norms)


class GroupNorm(FusableGroupNorm):
    """``nn.GroupNorm`` (same parameters and state-dict names) computed by ``group_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type):
            return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        if autocast_dtype_of_group_norm(x) != torch.float32:
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        with torch.autocast(x.device.type, enabled=False):  # the float32 policy, made explicit
            return group_norm(x.float(), self.num_groups, _fp32(self.weight), _fp32(self.bias), self.eps)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``F.silu(self(x))``, rounded to the dtype the next convolution computes in (autocast's, or the
        result's). With a kernel: one pass where the norm's dtype is float32 (autocast's CUDA policy, or a
        float32 ``x`` outside autocast), the same roundings as the two ops and the convolution's cast."""
        autocast = torch.is_autocast_enabled(x.device.type)
        if self.kernel is not None and autocast and autocast_dtype_of_group_norm(x) == torch.float32:
            with torch.autocast(x.device.type, enabled=False):
                return self.fused(x, norm_dtype=torch.float32, silu=True,
                                  out_dtype=torch.get_autocast_dtype(x.device.type))
        if self.kernel is not None and not autocast and x.dtype == torch.float32:
            return self.fused(x, norm_dtype=torch.float32, out_dtype=torch.float32, silu=True)
        return F.silu(self(x))


_POLICY: dict[tuple, torch.dtype] = {}


def autocast_dtype_of_group_norm(x: torch.Tensor) -> torch.dtype:
    """The dtype the active autocast gives ``F.group_norm(x)`` on ``x``'s device (float32 on CUDA, the input's
    on the CPU), probed once per (device type, autocast dtype, input dtype) on a two-element tensor."""
    key = (x.device.type, torch.get_autocast_dtype(x.device.type), x.dtype)
    if key not in _POLICY:
        _POLICY[key] = F.group_norm(torch.zeros(1, 1, 2, device=x.device, dtype=x.dtype), 1).dtype
    return _POLICY[key]


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()
