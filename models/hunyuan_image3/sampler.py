"""Flow-matching Euler sampler of HunyuanImage-3.0 (FlowMatchDiscreteScheduler, solver "euler").

Linear path x_sigma = (1 - sigma) x0 + sigma * noise; sigma = 1 is noise. The
model is given t = 1000 * sigma and predicts the velocity dx/dsigma, so one
step is x <- x + v * (sigma_next - sigma) (dt is negative). Everything here
runs in float32, whatever the model dtype.

Shape suffixes: B batch, C channels, h/w latent rows/cols, N steps.
"""
from __future__ import annotations

import torch


def flow_match_sigmas(steps: int, shift: float = 3.0) -> torch.Tensor:
    """float32 ``[steps + 1]``: linspace(1, 0) shifted SD3-style to s*shift / (1 + (shift - 1)*s)."""
    sigmas_N1 = torch.linspace(1, 0, steps + 1, dtype=torch.float32)
    return (shift * sigmas_N1) / (1 + (shift - 1) * sigmas_N1)


def flow_match_timesteps(sigmas_N1: torch.Tensor) -> torch.Tensor:
    """Model timesteps ``[steps]`` on the 0..1000 scale: sigmas[:-1] * 1000."""
    return sigmas_N1[:-1] * 1000


def euler_step(x_BChw: torch.Tensor, v_BChw: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """One Euler step along sigma, in float32."""
    return x_BChw.float() + v_BChw.float() * (sigma_next - sigma)


def cfg_combine(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance: uncond + scale * (cond - uncond), in float32."""
    v_uncond = v_uncond.float()
    return v_uncond + scale * (v_cond.float() - v_uncond)
