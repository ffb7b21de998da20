"""HunyuanImage-3.0-Instruct conditioning-image encoder: SigLIP2 naflex ViT + ``vision_aligner``.

Each conditioning image becomes ``max_num_patches`` tokens of the backbone
width (``vision_preprocess`` makes the patches):

    x     = patch_embedding(patches) + interp(position_embedding, grid)
    x     = x + out_proj(Attn(q, k, v of layer_norm1(x)))     per layer
    x     = x + fc2(gelu_tanh(fc1(layer_norm2(x))))
    h     = post_layernorm(x)                                  (last_hidden_state)
    feats = layers.2(gelu(layers.0(h)))                         (vision_aligner)

Padded patches are masked as KEYS only: their queries are computed like any
other and their outputs are kept (the official code scatters all
``max_num_patches`` aligner rows into the sequence). So every image is one
varlen attention run of ``P`` queries over its ``h * w`` real keys; a batch
of images of different grids is one packed call.

The checkpoint's ``vision_model.head.*`` (the SigLIP attention-pooling head)
is not built: the official Instruct code builds it but only reads
``last_hidden_state``, so the head never changes an output; ``load_state``
skips its keys.

Parameter names equal the checkpoint's ``vision_model.*`` / ``vision_aligner.*``.

Shape suffixes: B images, P = max_num_patches, T = B * P packed query rows,
S real (key) patches of all images, F = p * p * C values per patch,
D ViT width, N heads, H head dim, I MLP width, M backbone width.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from omni.build_options import BuildOptions
from omni.layers import Linear, embedding, finalize_all
from omni.specs import AttentionSpec, VarlenMeta
from omni.weights import LoadTarget, load_state_dict

from .vision_preprocess import VisionInputs, preprocess_batch

PREFIXES = ("vision_model.", "vision_aligner.")
SKIPPED = ("vision_model.head.",)  # pooling head: built by the official model, never read (module docstring)


@dataclass(frozen=True)
class VisionConfig:
    """The ``vit``, ``vit_processor`` and ``vit_aligner`` dicts of a checkpoint config, flattened."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    num_patches: int  # rows of the learned position table (a square grid)
    max_num_patches: int  # tokens per image, padding included
    aligner_dim: int  # ``vit_aligner.n_embed``: the backbone width
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    aligner_depth: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        side = round(self.num_patches ** 0.5)
        if side * side != self.num_patches:
            raise ValueError(f"vit.num_patches {self.num_patches} is not a square position table")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vit.hidden_size {self.hidden_size} not a multiple of {self.num_attention_heads} heads")

    @classmethod
    def from_dicts(cls, vit: Mapping[str, Any], processor: Mapping[str, Any],
                   aligner: Mapping[str, Any]) -> "VisionConfig":
        """Keys no code path reads (``_attn_implementation``, ``output_*``, ...) are ignored, as the loader does."""
        _require(vit, "hidden_act", "gelu_pytorch_tanh")
        _require(aligner, "projector_type", "mlp_gelu")
        if processor.get("patch_size", vit["patch_size"]) != vit["patch_size"]:
            raise ValueError(f"vit_processor.patch_size {processor['patch_size']} "
                             f"!= vit.patch_size {vit['patch_size']}")
        if aligner.get("input_dim", vit["hidden_size"]) != vit["hidden_size"]:
            raise ValueError(f"vit_aligner.input_dim {aligner['input_dim']} != vit.hidden_size {vit['hidden_size']}")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in vit.items() if k in known}
        kw.update({k: tuple(processor[k]) for k in ("image_mean", "image_std") if k in processor})
        return cls(**kw, max_num_patches=processor["max_num_patches"], aligner_dim=aligner["n_embed"],
                   aligner_depth=aligner.get("depth", 2))

    @classmethod
    def from_model_config(cls, cfg) -> "VisionConfig":
        """From a ``HunyuanImage3Config`` (or its json dict)."""
        get = cfg.get if isinstance(cfg, Mapping) else lambda k: getattr(cfg, k)
        return cls.from_dicts(get("vit"), get("vit_processor"), get("vit_aligner"))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.num_channels


def _require(d: Mapping[str, Any], key: str, want: str) -> None:
    if d.get(key, want) != want:
        raise ValueError(f"vision config: {key}={d[key]!r} is not supported (only {want!r})")


# ---------------------------------------------------------------- packing


@dataclass(frozen=True)
class VisionBatch:
    """What every layer needs to attend: the real-patch rows and the varlen runs (built once per forward)."""

    keys_S: torch.Tensor  # packed row index of each real patch, image by image
    meta: VarlenMeta  # query run b = image b's P rows; key run b = its h * w real patches


def pack(spatial_hw, max_num_patches: int, device) -> VisionBatch:
    """Real patches are the first ``h * w`` rows of each image's ``P`` (padding is at the end)."""
    P, n_B = max_num_patches, [h * w for h, w in spatial_hw]
    cu_q, cu_k = tuple(range(0, P * len(n_B) + 1, P)), (0, *itertools.accumulate(n_B))
    keys_S = torch.cat([torch.arange(n, device=device) + b * P for b, n in enumerate(n_B)])
    meta = VarlenMeta(cu_seqlens_q_B1=torch.tensor(cu_q, dtype=torch.int32, device=device),
                      cu_seqlens_k_B1=torch.tensor(cu_k, dtype=torch.int32, device=device),
                      max_seqlen_q=P, max_seqlen_k=max(n_B), cu_seqlens_q_host=cu_q, cu_seqlens_k_host=cu_k)
    return VisionBatch(keys_S, meta)


# ---------------------------------------------------------------- ViT


class VisionEmbeddings(nn.Module):
    """Linear patch embedding plus the learned position table resized to each image's grid."""

    def __init__(self, cfg: VisionConfig, *, platform, opts: BuildOptions):
        super().__init__()
        # raw pixels in: kept unquantized whatever the recipe (like lm_head on the text side)
        self.patch_embedding = Linear(cfg.patch_dim, cfg.hidden_size, platform=platform, dtype=opts.dtype, bias=True)
        self.position_embedding = embedding(cfg.num_patches, cfg.hidden_size, dtype=opts.dtype)
        self.side = round(cfg.num_patches ** 0.5)

    def positions(self, h: int, w: int, P: int) -> torch.Tensor:
        """``[P, D]``: the ``S x S`` table interpolated to ``h x w`` (bilinear, antialias), row-major;
        pad rows = row 0."""
        table = self.position_embedding.weight
        # the official code upcasts to fp32 on the CPU only (antialias needs it there); fp32 everywhere here
        grid_1DSS = table.float().T.reshape(1, -1, self.side, self.side)
        pos_nD = F.interpolate(grid_1DSS, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        pos_nD = pos_nD.reshape(-1, h * w).T.to(table.dtype)
        return torch.cat([pos_nD, pos_nD[:1].expand(P - h * w, -1)])

    def forward(self, pixels_BPF: torch.Tensor, spatial_hw) -> torch.Tensor:
        B, P, _ = pixels_BPF.shape
        pos_TD = torch.cat([self.positions(h, w, P) for h, w in spatial_hw])
        return self.patch_embedding(pixels_BPF.reshape(B * P, -1).to(pos_TD.dtype)) + pos_TD


class VisionAttention(nn.Module):
    """Multi-head attention (biased q/k/v/out projections); keys and values only from real patches."""

    def __init__(self, cfg: VisionConfig, *, platform, opts: BuildOptions):
        super().__init__()
        D, N, H = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        kw = dict(platform=platform, bias=True, **opts.linear_kw(opts.dense_quant))
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(D, D, **kw) for _ in range(4))
        self.shape_NH = (N, H)
        self.attn = platform.attention(AttentionSpec(num_heads=N, num_kv_heads=N, head_dim=H, dtype=opts.dtype,
                                                     mask="none", backend=opts.attn_backend, scale=H ** -0.5))

    def forward(self, x_TD: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        x_SD = x_TD.index_select(0, batch.keys_S)
        q_TNH = self.q_proj(x_TD).unflatten(-1, self.shape_NH)
        k_SNH = self.k_proj(x_SD).unflatten(-1, self.shape_NH)
        v_SNH = self.v_proj(x_SD).unflatten(-1, self.shape_NH)
        return self.out_proj(self.attn(q_TNH, k_SNH, v_SNH, batch.meta).flatten(1))


class VisionMLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``."""

    def __init__(self, cfg: VisionConfig, *, platform, opts: BuildOptions):
        super().__init__()
        kw = dict(platform=platform, bias=True, **opts.linear_kw(opts.dense_quant))
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x_TD), approximate="tanh"))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, *, platform, opts: BuildOptions):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=opts.dtype)
        self.self_attn = VisionAttention(cfg, platform=platform, opts=opts)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=opts.dtype)
        self.mlp = VisionMLP(cfg, platform=platform, opts=opts)

    def forward(self, x_TD: torch.Tensor, batch: VisionBatch) -> torch.Tensor:
        h_TD = x_TD + self.self_attn(self.layer_norm1(x_TD), batch)
        return h_TD + self.mlp(self.layer_norm2(h_TD))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, *, platform, opts: BuildOptions):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, platform=platform, opts=opts)
                                    for _ in range(cfg.num_hidden_layers))


class VisionTransformer(nn.Module):
    """The checkpoint's ``vision_model.`` (SigLIP2 naflex, without the pooling head)."""

    def __init__(self, cfg: VisionConfig, *, platform, opts: BuildOptions):
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg, platform=platform, opts=opts)
        self.encoder = VisionEncoder(cfg, platform=platform, opts=opts)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=opts.dtype)

    def forward(self, inputs: VisionInputs) -> torch.Tensor:
        """``last_hidden_state`` ``[B, P, D]``; padded rows included."""
        B, P, _ = inputs.pixel_values_BPF.shape
        batch = pack(inputs.spatial_hw, P, inputs.pixel_values_BPF.device)
        x_TD = self.embeddings(inputs.pixel_values_BPF, inputs.spatial_hw)
        for layer in self.encoder.layers:
            x_TD = layer(x_TD, batch)
        return self.post_layernorm(x_TD).view(B, P, -1)


class VisionAligner(nn.Module):
    """``mlp_gelu``: Linear(D, M), then (exact GELU, Linear(M, M)) ``depth - 1`` times (``layers.0/2/...``)."""

    def __init__(self, cfg: VisionConfig, *, platform, opts: BuildOptions):
        super().__init__()
        kw = dict(platform=platform, bias=True, **opts.linear_kw(opts.dense_quant))
        M = cfg.aligner_dim
        layers = [Linear(cfg.hidden_size, M, **kw)]
        for _ in range(cfg.aligner_depth - 1):
            layers += [nn.GELU(), Linear(M, M, **kw)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# ---------------------------------------------------------------- the whole encoder


class HunyuanVisionEncoder(nn.Module):
    """``vision_model`` + ``vision_aligner``: uint8 images -> ``[B, P, M]`` conditioning tokens."""

    def __init__(self, cfg: VisionConfig, platform, opts: BuildOptions):
        super().__init__()
        self.cfg = cfg
        self.vision_model = VisionTransformer(cfg, platform=platform, opts=opts)
        self.vision_aligner = VisionAligner(cfg, platform=platform, opts=opts)
        self.requires_grad_(False)

    def preprocess(self, images) -> VisionInputs:
        """uint8 ``[H, W, C]`` images (any sizes) -> padded patches on this module's device."""
        return preprocess_batch(images, self.cfg).to(self.vision_model.post_layernorm.weight.device)

    def forward(self, inputs: VisionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(``last_hidden_state`` ``[B, P, D]``, aligner features ``[B, P, M]``), padded rows included."""
        h_BPD = self.vision_model(inputs)
        return h_BPD, self.vision_aligner(h_BPD)

    @torch.no_grad()
    def encode(self, images) -> torch.Tensor:
        """Aligner features ``[n_img, max_num_patches, M]`` of several images, in one packed forward."""
        return self(self.preprocess(images))[1]

    def finalize(self) -> None:
        """Prepare every kernel-backed weight once, after loading."""
        finalize_all(self)


def load_state(model: HunyuanVisionEncoder, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy the ``vision_model.*`` / ``vision_aligner.*`` tensors (official names) into ``model``.

    Other checkpoint parts and the unused pooling head (``vision_model.head.*``)
    are skipped; a missing, unexpected or mis-shaped vision key raises
    ``CheckpointError``.
    """
    ours = {k: v for k, v in tensors.items() if k.startswith(PREFIXES)}
    load_state_dict(ours, [LoadTarget("", model)], skip_prefixes=SKIPPED)
