"""The embedded defaults: tiny HunyuanImage-3.0 checkpoints (base and Instruct).

Same architecture and checkpoint layout as the released model (official
names, per-expert tensors, ``config.json``, ``tokenizer.json``, two shards
with ``model.safetensors.index.json``), with tiny widths so the whole
text-to-image path runs on a CPU in seconds.

``trained`` (flavour ``hunyuan_image3_tiny``, the default) ships in the
package (``assets/tiny_trained/``, model card beside it): trained by
``train_tiny`` to draw coloured shapes at named positions at 128x128.
``instruct_trained`` (``hunyuan_image3_instruct_tiny``,
``assets/tiny_instruct_trained/``) is trained from it on edit pairs
("make the circle green") at 256x256. Both are read in place by the same
loader as any checkpoint.

``base`` (``hunyuan_image3_tiny_random``) and ``instruct``
(``hunyuan_image3_instruct_tiny_random``) are generated here with random
weights (seed 0): images look like coloured noise; they exist so that every
code path runs with no download. The generator writes the directory once;
later runs reuse it.

The Instruct one adds what editing needs: a tiny SigLIP2 ViT and aligner
(``vision_model.*``, ``vision_aligner.*``), the VAE encoder, the Instruct
vocabulary and ``image_base_size`` 256 (so a reference image is VAE-encoded
at about 256x256 pixels and the CPU path stays fast).
"""
from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

FORMAT_VERSION = 2
INSTRUCT_FORMAT_VERSION = 1
TINY_CONFIG = {
    "architectures": ["HunyuanImage3ForCausalMM"], "model_type": "hunyuan_image_3_moe",
    "vocab_size": 64, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "attention_head_dim": 16, "num_hidden_layers": 2, "intermediate_size": 48,
    "moe_intermediate_size": [32, 32], "num_experts": 4, "moe_topk": [2, 2], "num_shared_expert": [1, 1],
    "use_mixed_mlp_moe": True, "moe_layer_num_skipped": 0, "norm_topk_prob": True,
    "hidden_act": "silu", "use_qk_norm": True, "norm_type": "rms", "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "rope_scaling": {"type": "custom", "factor": 1.0}, "rope_type": "2d",
    "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "pad_id": 0,
    "img_proj_type": "unet", "patch_size": 1, "patch_embed_hidden_dim": 32, "image_base_size": 1024,
    "vae_downsample_factor": [16, 16], "torch_dtype": "float32",
    "vae": {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [32, 32, 32, 32, 32],
            "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 1,
            "ffactor_spatial": 16, "ffactor_temporal": 1, "downsample_match_channel": True,
            "upsample_match_channel": True, "scaling_factor": 0.562679178327931},
}

TINY_INSTRUCT_CONFIG = {
    **TINY_CONFIG, "vocab_size": 79, "image_base_size": 256, "model_version": "HunyuanImage-3.0-Instruct",
    "cond_image_type": "vae_vit", "cond_token_attn_type": "joint_full", "vit_type": "siglip2-so400m-patch16-naflex",
    "vit": {"hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "intermediate_size": 64, "layer_norm_eps": 1e-6,
            "num_attention_heads": 2, "num_channels": 3, "num_hidden_layers": 1, "num_patches": 16,
            "patch_size": 16},
    "vit_processor": {"max_num_patches": 64, "patch_size": 16},
    "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2},
}
KINDS = {"base": (TINY_CONFIG, "tiny_tokenizer.json", FORMAT_VERSION),
         "instruct": (TINY_INSTRUCT_CONFIG, "tiny_instruct_tokenizer.json", INSTRUCT_FORMAT_VERSION)}


TRAINED_ASSETS = {"trained": "tiny_trained", "instruct_trained": "tiny_instruct_trained"}  # kind -> asset dir


def trained_checkpoint_dir(kind: str = "trained") -> Path:
    """A shipped trained checkpoint (a directory inside the installed package): ``trained`` (base) or
    ``instruct_trained`` (the editing model, ``train_tiny.instruct``)."""
    return Path(str(resources.files("omni.models.hunyuan_image3.assets").joinpath(TRAINED_ASSETS[kind])))


def default_cache_dir(kind: str = "base") -> Path:
    name = "hunyuan_image3_tiny" if kind == "base" else f"hunyuan_image3_{kind}_tiny"
    return Path.home() / ".cache" / "omni-run" / f"{name}-v{KINDS[kind][2]}"


def _init_(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    """Non-degenerate random init: norms near 1, small biases, fan-in scaled matrices."""
    r = torch.randn(p.shape, generator=g)
    if p.dim() == 1:
        p.copy_(1 + 0.1 * r if name.endswith("weight") else 0.05 * r)
    else:
        p.copy_(r / (p[0].numel() ** 0.5))


def official_tensors(modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """State dicts under official names: prefix per module, stacked experts split per expert."""
    out = {}
    for prefix, module in modules.items():
        for name, t in module.state_dict().items():
            if ".mlp.experts." in name and t.dim() == 3:
                head, leaf = name.split(".mlp.experts.")
                out.update({f"{prefix}{head}.mlp.experts.{e}.{leaf}": t[e].contiguous() for e in range(t.shape[0])})
            else:
                out[prefix + name] = t.contiguous()
    return out


def _modules(config: dict) -> dict[str, torch.nn.Module]:
    """The checkpoint's modules by official-name prefix, freshly built (random weights follow)."""
    from omni.build_options import BuildOptions
    from omni.platform_manager import select

    from .config import HunyuanImage3Config
    from .transformer import HunyuanImage3Transformer
    from .vae import AutoencoderKLConv3D, VAEConfig
    from .vision import HunyuanVisionEncoder, VisionConfig

    platform, opts = select("cpu"), BuildOptions(dtype=torch.float32)
    modules = {"": HunyuanImage3Transformer(HunyuanImage3Config.from_json_dict(config), platform, opts),
               "vae.": AutoencoderKLConv3D(VAEConfig.from_dict(config["vae"]))}
    if "vit" in config:  # the Instruct checkpoints carry the vision encoder
        modules["vision."] = HunyuanVisionEncoder(VisionConfig.from_model_config(config), platform, opts)
    return modules


def write_tiny_checkpoint(dest: Path, kind: str = "base") -> Path:
    """Generate the tiny checkpoint of ``kind`` (base | instruct) into ``dest`` (atomically) and return it."""
    config, tokenizer_asset, _ = KINDS[kind]
    tok = resources.files("omni.models.hunyuan_image3.assets").joinpath(tokenizer_asset)
    return write_random_checkpoint(dest, config, tok.read_text())


def write_random_like(dest: Path, source: Path) -> Path:
    """Random weights (seed 0) with ``source``'s config and tokenizer: what the gate of a trained
    checkpoint must fail on (tests/test_quality_tiny.py)."""
    source = Path(source)
    config = json.loads((source / "config.json").read_text())
    return write_random_checkpoint(dest, config, (source / "tokenizer.json").read_text())


def write_random_checkpoint(dest: Path, config: dict, tokenizer_json: str) -> Path:
    """A checkpoint of ``config`` with seeded random weights and ``tokenizer_json``, written atomically."""
    modules = _modules(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in modules.values():
            for name, p in m.named_parameters():
                _init_(name, p, g)
    vision = modules.pop("vision.", None)
    tensors = official_tensors(modules)
    if vision is not None:  # HunyuanVisionEncoder's own names are already the official ones
        tensors.update({k: t.contiguous() for k, t in vision.state_dict().items()})
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_shards(tmp, tensors)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "tokenizer.json").write_text(tokenizer_json)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def _write_shards(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Two shards (backbone / the rest) plus the index, as large checkpoints ship."""
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": [n for n in names if n.startswith("model.")],
              "model-00002-of-00002.safetensors": [n for n in names if not n.startswith("model.")]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(root / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def ensure_tiny_checkpoint(cache_dir: Path | None = None, kind: str = "base") -> Path:
    """The tiny checkpoint directory of ``kind``: the shipped one for ``trained`` | ``instruct_trained``;
    ``base`` | ``instruct`` (random weights) generated on first use (into ``cache_dir`` or the user cache)."""
    if kind in TRAINED_ASSETS:
        return trained_checkpoint_dir(kind)
    dest = Path(cache_dir) if cache_dir else default_cache_dir(kind)
    if not (dest / "model.safetensors.index.json").is_file():
        write_tiny_checkpoint(dest, kind)
    return dest
