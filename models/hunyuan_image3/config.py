"""HunyuanImage-3.0 hyper-parameters, loaded from a released ``config.json``.

The dataclass defaults are the released values (tencent/HunyuanImage-3.0; the
Instruct and Instruct-Distil checkpoints have the same shapes). The config
class of the official code has *different* defaults (vocab 290943, ...), so a
checkpoint is always described by its json, never by those defaults.

Keys fall in four groups:
- fields of :class:`HunyuanImage3Config` (per-layer lists become tuples);
- ``_FIXED``: switches this implementation supports with one value only
  (e.g. ``use_qk_norm=true``); any other value is a ``ValueError``;
- ``_IGNORED``: documented keys that no code path of the model reads;
- anything else is a ``ValueError`` naming the keys, so a config this code
  does not understand is never half-loaded.

The nested ``vae``, ``vit``, ``vit_processor`` and ``vit_aligner`` dicts are
kept raw; ``vae.VAEConfig.from_dict`` parses the first.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

_FIXED: dict[str, Any] = {
    "hidden_act": "silu", "norm_type": "rms", "use_qk_norm": True, "use_rotary_pos_emb": True,
    "attention_bias": False, "mlp_bias": False, "use_cla": False, "use_mla": False,
    "tie_word_embeddings": False, "use_mixed_mlp_moe": True, "moe_layer_num_skipped": 0,
    "norm_topk_prob": True, "routed_scaling_factor": False, "group_limited_greedy": False,
    "moe_drop_tokens": False, "img_proj_type": "unet", "rope_type": "2d",
}

_IGNORED = frozenset({
    # bookkeeping and training-only
    "model_version", "architectures", "auto_map", "model_type", "torch_dtype", "transformers_version",
    "initializer_range", "attention_dropout", "use_cache", "pretraining_tp", "moe_impl", "capacity_factor",
    "moe_random_routing_dropped_token", "n_group", "topk_group", "add_classification_head", "class_num",
    "pool_type", "skip_cls_token", "dense_list",
    # Hunyuan-A13B leftovers (MLA/CLA/xdrope/anyres/resampler ViT) that this model never builds
    "cla_share_factor", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "position_embedding_xdrope", "xdrope_section", "anyres_pooling_size", "anyres_vit_max_image_size",
    "anyres_vit_two_views", "num_media_embeds", "vit_add_patchemb_bias", "vit_input_resolution",
    "vit_mapping_type", "vit_norm_type", "vit_patch", "vit_path", "vit_remove_prenorm", "vit_token",
    "vit_used_rms_norm", "vit_downsample_factor",
    # special ids the tokenizer, not the model, owns
    "eod_token_id", "im_newline_id", "mask_init_id", "text_start_id", "text_end_id",
    "video_start_id", "video_end_id", "pad_id",
    # VAE placement (the VAE module decides these)
    "vae_type", "vae_dtype", "vae_autocast_dtype",
})

_PER_LAYER = ("moe_topk", "moe_intermediate_size", "num_shared_expert")


_RELEASED_VAE = {
    "_class_name": "AutoencoderKLConv3D", "block_out_channels": [128, 256, 512, 1024, 1024],
    "in_channels": 3, "out_channels": 3, "latent_channels": 32, "layers_per_block": 2,
    "ffactor_spatial": 16, "ffactor_temporal": 4, "sample_size": 384, "sample_tsize": 96,
    "downsample_match_channel": True, "upsample_match_channel": True, "scaling_factor": 0.562679178327931,
}
_RELEASED_VIT = {
    "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 4304, "layer_norm_eps": 1e-6,
    "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 27, "num_patches": 256, "patch_size": 16,
}
_RELEASED_VIT_PROCESSOR = {"max_num_patches": 1024, "patch_size": 16}
_RELEASED_VIT_ALIGNER = {"projector_type": "mlp_gelu", "input_dim": 1152, "n_embed": 4096, "depth": 2}


@dataclass(frozen=True)
class HunyuanImage3Config:
    """Backbone, image-head and token-id hyper-parameters; defaults are the released model."""

    vocab_size: int = 133120
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    attention_head_dim: int = 128
    intermediate_size: int = 3072  # dense MLP width; no dense layer is ever built
    num_experts: int = 64
    moe_topk: tuple[int, ...] = (8,) * 32
    moe_intermediate_size: tuple[int, ...] = (3072,) * 32
    num_shared_expert: tuple[int, ...] = (1,) * 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 22800
    bos_token_id: int = 127958
    eos_token_id: int = 127957
    pad_token_id: int = 128009
    im_start_id: int = 128000
    im_end_id: int = 128001
    image_token_id: int = 128006
    patch_size: int = 1
    patch_embed_hidden_dim: int = 1024
    image_base_size: int = 1024
    vae_downsample_factor: tuple[int, int] = (16, 16)
    cfg_distilled: bool = False  # Distil: adds guidance_emb and a <guidance> token
    use_meanflow: bool = False  # Distil: adds timestep_r_emb and a <timestep_r> token
    cond_image_type: str = "vae_vit"
    cond_token_attn_type: str = "joint_full"
    vit_type: str = "siglip2-so400m-patch16-naflex"
    vae: Mapping[str, Any] = field(default_factory=lambda: dict(_RELEASED_VAE), hash=False)
    vit: Mapping[str, Any] = field(default_factory=lambda: dict(_RELEASED_VIT), hash=False)
    vit_processor: Mapping[str, Any] = field(default_factory=lambda: dict(_RELEASED_VIT_PROCESSOR), hash=False)
    vit_aligner: Mapping[str, Any] = field(default_factory=lambda: dict(_RELEASED_VIT_ALIGNER), hash=False)

    def __post_init__(self) -> None:
        for name in _PER_LAYER + ("vae_downsample_factor",):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in _PER_LAYER:
            if len(getattr(self, name)) != self.num_hidden_layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if max(self.moe_topk) > self.num_experts or min(self.num_shared_expert) < 1:
            raise ValueError("moe_topk must be <= num_experts and every layer needs a shared expert")

    # ------------------------------------------------------------- loading

    @classmethod
    def from_json_dict(cls, d: Mapping[str, Any]) -> "HunyuanImage3Config":
        """Build from a released config.json dict (see the module docstring for the key groups)."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        if "head_dim" in d:  # newer configs carry both names
            kwargs.setdefault("attention_head_dim", d["head_dim"])
        _check_fixed(d)
        _check_head_dim(d)
        _check_rope_scaling(d.get("rope_scaling"))
        unknown = sorted(set(d) - known - _FIXED.keys() - _IGNORED - {"head_dim", "rope_scaling"})
        if unknown:
            raise ValueError(f"HunyuanImage3Config: unknown config keys {unknown}")
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: str | Path) -> "HunyuanImage3Config":
        return cls.from_json_dict(json.loads(Path(path).read_text()))

    @classmethod
    def released(cls) -> "HunyuanImage3Config":
        """The released base / Instruct shapes (80B total, 13B active)."""
        return cls()

    # ------------------------------------------------------------- derived

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def latent_channels(self) -> int:
        return int(self.vae.get("latent_channels", 32))

    def image_token_grid(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) image tokens of an image of ``height`` x ``width`` pixels."""
        fy, fx = self.vae_downsample_factor
        return height // fy // self.patch_size, width // fx // self.patch_size


def _check_fixed(d: Mapping[str, Any]) -> None:
    bad = {k: d[k] for k, want in _FIXED.items() if k in d and d[k] != want}
    if bad:
        raise ValueError(f"HunyuanImage3Config: unsupported values {bad}; this implementation needs "
                         + str({k: _FIXED[k] for k in bad}))


def _check_head_dim(d: Mapping[str, Any]) -> None:
    if "head_dim" in d and d.get("attention_head_dim", d["head_dim"]) != d["head_dim"]:
        raise ValueError(f"head_dim {d['head_dim']} != attention_head_dim {d['attention_head_dim']}")


def _check_rope_scaling(rope_scaling: Mapping[str, Any] | None) -> None:
    """Only ``type`` is read by the official code; "custom" means the plain 2-D RoPE."""
    if rope_scaling is not None and rope_scaling.get("type") not in ("custom", None):
        raise ValueError(f"rope_scaling type {rope_scaling.get('type')!r} is not supported (only 'custom')")


# The tiny configuration of shared/golden/hunyuan_image3_tiny.json ("tiny_config"): 2 layers, hidden 64,
# 4 heads / 2 KV heads of 16, 4 experts top-2, latent channels 4. vae_downsample_factor 256 only makes the
# 1024-base ratio table give 4x4 / 3x4 token grids; the tiny VAE itself downsamples by 4.
TINY_GOLDEN = HunyuanImage3Config(
    vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    attention_head_dim=16, intermediate_size=48, num_experts=4, moe_topk=(2, 2), moe_intermediate_size=(32, 32),
    num_shared_expert=(1, 1), max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    patch_embed_hidden_dim=32, vae_downsample_factor=(256, 256),
    vae={"_class_name": "AutoencoderKLConv3D", "block_out_channels": [32, 32, 64], "in_channels": 3,
         "out_channels": 3, "latent_channels": 4, "layers_per_block": 1, "ffactor_spatial": 4,
         "ffactor_temporal": 2, "sample_size": 16, "sample_tsize": 8, "downsample_match_channel": True,
         "upsample_match_channel": True, "scaling_factor": 0.562679178327931},
    vit={"_attn_implementation": "sdpa", "attention_dropout": 0.0, "hidden_act": "gelu_pytorch_tanh",
         "hidden_size": 32, "intermediate_size": 64, "layer_norm_eps": 1e-06, "num_attention_heads": 2,
         "num_channels": 3, "num_hidden_layers": 1, "num_patches": 16, "patch_size": 2,
         "output_attentions": False, "output_hidden_states": False, "use_return_dict": True},
    vit_processor={"max_num_patches": 16, "patch_size": 2},
    vit_aligner={"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2},
)

FLAVORS: dict[str, HunyuanImage3Config] = {"released": HunyuanImage3Config.released(), "tiny_golden": TINY_GOLDEN}
