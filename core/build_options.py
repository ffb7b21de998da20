"""The choices a model is built with, read off the recipe once: ``BuildOptions``.

Every layer module takes ``(cfg, layer_idx, *, platform, opts)``: the config
says the shapes, the options say precision, KV layout and kernel choices, and
the platform answers the specs built from both. The parallel plan rebuilds
modules and attention kernels from the same options, so a shard is built
exactly as the whole model was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .specs import GROUPED_SKINNY_ROWS, GROUPED_SMALL_ROWS, PDL_ROWS, SKINNY_ROWS, AttentionSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # recipe name -> dtype


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildOptions:
    """How every layer of one model is built (frozen: one object shared by all modules).

    Values are checked where they are used, by the specs built from them
    (``omni.specs``), and before that by the recipe schema.
    """

    dtype: torch.dtype  # ``model.dtype``: weights and activations (the router runs in fp32)
    quant: str = "none"  # ``quant.scheme``: the linear layers' scheme, one of ``omni.specs.QUANT_SCHEMES``
    experts_only: bool = False  # ``quant.experts_only``: attention and the shared expert keep ``dtype``
    paged_kv: bool = False  # ``kv_cache.mode == "paged"``: attention reads keys/values through block tables
    page_size: int = 0  # ``kv_cache.page_tokens`` when paged, else 0
    attn_backend: str = "auto"  # ``attention.backend``: the attention kernel the platform should prefer
    capturable: bool = False  # ``graph.mode == "capture"``: the denoising step is recorded into a device graph
    memory_bound: str = "auto"  # ``kernels.memory_bound``: auto | triton | torch (``omni.specs.MEMORY_BOUND``)
    attn_fp8: bool = False  # ``attention.fp8``: e4m3 Q/K/V in the attention products (docs/quality.md gates it)
    fast_accum: bool = False  # ``kernels.fp8_fast_accum``: fp8 GEMMs may skip fp32 promotion (docs/quality.md)
    grouped_fp8: str = "auto"  # ``kernels.grouped_fp8``: the fp8 expert GEMMs' kernel (``omni.specs.GROUPED_FP8``)
    grouped_small_rows: int = GROUPED_SMALL_ROWS  # ``kernels.grouped_fp8_small_rows``: rows per expert, small tile
    grouped_skinny_rows: int = GROUPED_SKINNY_ROWS  # ``kernels.grouped_fp8_skinny_rows``: tokens, few-row kernel
    skinny_rows: int = SKINNY_ROWS  # ``kernels.fp8_skinny_rows``: dense fp8 GEMMs of this many rows, few-row kernel
    shared_expert_stream: bool = False  # ``kernels.shared_expert_stream``: the shared expert beside the routed path
    pdl_rows: int = PDL_ROWS  # ``kernels.pdl_rows``: calls of at most this many rows launch with PDL
    fuse_shared_expert: bool = False  # ``kernels.fuse_shared_expert``: the shared expert as the last routed group

    @classmethod
    def from_recipe(cls, recipe) -> BuildOptions:
        paged = recipe.kv_cache.mode == "paged"
        return cls(dtype=DTYPES[recipe.model.dtype], quant=recipe.quant.scheme, experts_only=recipe.quant.experts_only,
                   paged_kv=paged, page_size=recipe.kv_cache.page_tokens if paged else 0,
                   attn_backend=recipe.attention.backend, capturable=recipe.graph.mode == "capture",
                   memory_bound=recipe.kernels.memory_bound, attn_fp8=recipe.attention.fp8,
                   fast_accum=recipe.kernels.fp8_fast_accum, grouped_fp8=recipe.kernels.grouped_fp8,
                   grouped_small_rows=recipe.kernels.grouped_fp8_small_rows,
                   grouped_skinny_rows=recipe.kernels.grouped_fp8_skinny_rows,
                   skinny_rows=recipe.kernels.fp8_skinny_rows,
                   shared_expert_stream=recipe.kernels.shared_expert_stream, pdl_rows=recipe.kernels.pdl_rows,
                   fuse_shared_expert=recipe.kernels.fuse_shared_expert)

    def linear_kw(self, quant: str) -> dict:
        """The kernel choices every ``Linear`` of the model is built with, for the scheme ``quant``."""
        return dict(dtype=self.dtype, quant=quant, memory_bound=self.memory_bound, fast_accum=self.fast_accum,
                    skinny_rows=self.skinny_rows, pdl_rows=self.pdl_rows)

    def expert_kw(self) -> dict:
        """The kernel choices of the routed experts (``quant`` and the grouped GEMMs' own)."""
        return dict(dtype=self.dtype, quant=self.quant, memory_bound=self.memory_bound, fast_accum=self.fast_accum,
                    grouped_fp8=self.grouped_fp8, small_rows=self.grouped_small_rows,
                    skinny_rows=self.grouped_skinny_rows, pdl_rows=self.pdl_rows)

    @property
    def dense_quant(self) -> str:
        """The scheme of the layers outside the routed experts (attention, shared expert)."""
        return "none" if self.experts_only else self.quant

    def attention_spec(self, N: int, K: int, H: int, mask: str) -> AttentionSpec:
        """The attention kernel's spec for N query heads, K kv heads of width H under ``mask``."""
        return AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=self.dtype, mask=mask,
                             paged=self.paged_kv, page_size=self.page_size, backend=self.attn_backend,
                             capturable=self.capturable and mask == "none",  # only the denoising step is captured
                             fp8=self.attn_fp8 and mask != "dense", memory_bound=self.memory_bound)
