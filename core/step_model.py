"""What the step engine (``omni.step_engine``) asks of a model: rows, one packed forward, the sampler.

A *row* is one token sequence of a request (a CFG pair has two rows of the
same length). Its first ``prefix_len`` tokens are the *prefix*: computed once
by the prefill, their K/V kept in the pool. The prefill runs the prefix's
*segments* in order, each one forward over the segments of that index of
every row: a ``causal`` segment sees the keys before it and itself causally,
a ``none`` segment (a fully visible block, such as a reference image) sees
the keys before it and all of itself. The ``block_len`` tokens after the
prefix are the *step block*: rebuilt from the latents at every denoising
step and run against the cached prefix. The latent grid ``token_h x
token_w`` is the same for every row of a request, which shares one latent.

Per step the engine asks the model for each request's block input, packs
the blocks of every request into one forward (``backbone`` over a
``PoolContext`` of ``Run``s), splits the output back per request and asks
the model for the rows' velocities and the sampler update. The model never
sees the pool's pages, the other requests, the runtime or the step cache.

Shape suffixes: T packed tokens, D hidden, H head dim (rope tables), B rows,
C latent channels, h/w latent grid, 3HW pixels.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .request import ImageRequest


class RowSpec(Protocol):
    """One row: every token of its sequence, the prefix length and the latent grid."""

    ids: Sequence[int]  # token ids of the whole row (the prefix is ids[:prefix_len])
    pos_yx: Sequence[tuple[int, int]]  # each token's rope position
    token_h: int
    token_w: int

    @property
    def prefix_len(self) -> int: ...


class StepModel(Protocol):
    """The model side of a packed denoise step (see the module docstring)."""

    pixels_per_latent: int  # VAE upsampling factor (tiled decode places tiles with it)

    def build_rows(self, req: ImageRequest) -> list[RowSpec]:
        """The request's rows in guidance order (conditional first); all of them, on every worker."""

    def block_len(self, row: RowSpec) -> int:
        """Tokens of the row's step block (right after its prefix)."""

    def block_spans(self, row: RowSpec) -> list[tuple[int, int]]:
        """The block's query spans ``[q_start, q_end)`` (row positions); each attends to keys ``[0, q_end)``."""

    def rope(self, pos_yx: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos_TH, sin_TH)`` of these positions, on the device in the model's dtype."""

    def prefix_input(self, req: ImageRequest, seed: int, rows: list[RowSpec], cached: int = 0) -> list[torch.Tensor]:
        """``x_LD`` per row: the input of each row's whole prefix (token embeddings, plus whatever the
        model places there, such as encoded reference images; ``seed`` is the request's). Positions
        before ``cached`` have their K/V in the pool already: their input is not read and need not be
        computed (a model may skip encoding what only lives there)."""

    def prefix_segments(self, row: RowSpec) -> list[tuple[int, int, str]]:
        """``(start, stop, mask)`` covering ``[0, prefix_len)`` in order; mask ``causal`` or ``none``."""

    def block_input(self, latents_1Chw: torch.Tensor, sigma: float, rows: list[RowSpec], *, sigma_next: float,
                    guidance: float) -> torch.Tensor:
        """``x_TD``: the step blocks of ``rows`` (one request's rows here) at noise level ``sigma`` (a
        distilled model also embeds the next level and the guidance scale)."""

    def backbone(self, x_TD: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor, ctx) -> torch.Tensor:
        """One packed forward; attention reads and writes K/V through ``ctx`` (a ``PoolContext``)."""

    def velocity(self, h_TD: torch.Tensor, rows: list[RowSpec], sigma: float) -> torch.Tensor:
        """``v_BChw`` fp32: one request's block outputs (its rows here, packed) -> one velocity per row."""

    def noise(self, seed: int, row: RowSpec) -> torch.Tensor:
        """``latents_1Chw`` fp32 on the device: the initial noise, a function of the seed only."""

    def sigmas(self, req: ImageRequest) -> torch.Tensor:
        """The noise schedule, fp32 ``[steps + 1]`` on the host, from 1 (noise) to 0."""

    def sample_step(self, latents_1Chw: torch.Tensor, v_BChw: torch.Tensor, sigma: torch.Tensor,
                    sigma_next: torch.Tensor, guidance: float) -> torch.Tensor:
        """Guidance over the request's rows (all of them), then one sampler step from sigma to sigma_next."""

    def decode_latents(self, z_BChw: torch.Tensor) -> torch.Tensor:
        """Latents -> pixels ``x_B3HW`` in [-1, 1] (the VAE decoder; may return a buffer it reuses)."""
