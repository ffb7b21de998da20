"""The per-device memory estimate of a recipe for the released model.

Arithmetic on the released model config (``ModelFlavor.released_config()``),
not a measurement; ``omni.recipe_docs`` renders it into docs/recipes/. Per device:

    weights     every module group's parameters x bytes per parameter / its split
                (tp, ep; see ``weight_parts``), on the device, streamed or on the host
                as ``offload`` says
    KV pool     ``kv_cache.budget_bytes`` (the pool allocates whole pages within it)
    activations ``A = T x b x (4 D + W_qkv + r (2 D + 3 I_loc))`` for the
                ``T = max_batch_tokens / (cfg x ulysses x ring)`` tokens of one forward
                on this device (see ``activation_bytes``)
    verdict     fits when the usable memory (``device.memory_limit_gib`` when the
                recipe caps its share of the card, else ``device.memory_gib``) leaves
                ``RESERVE_GIB`` over the sum
                (runtime context, allocator slack, the VAE decode's workspace: not
                modelled, so reserved)

Imports neither torch nor a platform: the model config and its parallel plan
are plain data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .parallel.mesh import Degrees, MeshError, expert_layout
from .recipe import GiB, Recipe

RESERVE_GIB = 4.0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANT_BYTES = {"fp8_tensor": 1.0, "fp8_row": 1.0, "w8a8": 1.0, "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
VAE_PARAMS = 871_000_000  # the decoder alone: text-to-image builds no encoder (389M) (hunyuan_image3.md s2)


# ------------------------------------------------------------------ parameter counts from the config


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of each module group of the transformer and the VAE (whole model, not per device)."""

    layers: int
    experts: int  # routed experts, all layers
    attention: int  # qkv_proj + o_proj, all layers
    shared: int  # shared experts, all layers
    router: int  # mlp.gate.wg, fp32
    norms: int  # RMSNorm weights (layer norms, QK norms, ln_f)
    wte: int
    lm_head: int
    image_io: int  # patch_embed + final_layer + timestep embedders
    vae: int

    @property
    def backbone(self) -> int:
        """Backbone plus lm_head: the "80.96 B" of the released model."""
        return self.experts + self.attention + self.shared + self.router + self.norms + self.wte + self.lm_head


BASE_FLAVOR = "hunyuan_image3"  # what param_counts() and the docs' index describe without a recipe


def released_config(flavor: str = BASE_FLAVOR):
    """The released checkpoint's config of ``flavor`` (through the model registry); None: not estimated."""
    from .model_registry import entry

    return entry(flavor).released_config()


def _resblock(c_in: int, c_out: int, emb: int) -> int:
    """ADM ResBlock (GN, conv3, emb Linear -> 2 c_out, GN, conv3, 1x1 skip when channels change)."""
    skip = c_in * c_out + c_out if c_in != c_out else 0
    return 2 * c_in + (9 * c_in * c_out + c_out) + (emb * 2 * c_out + 2 * c_out) + 2 * c_out \
        + (9 * c_out * c_out + c_out) + skip


def param_counts(cfg=None) -> ParamCounts:
    """Counts from a ``HunyuanImage3Config`` (default: the released one); patch_size 1 image heads."""
    cfg = cfg or released_config()
    L, D, E, H = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.head_dim
    N, K, C, hid = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.latent_channels, cfg.patch_embed_hidden_dim
    swiglu = [3 * D * i for i in cfg.moe_intermediate_size]  # gate_and_up [2I, D] + down [D, I]
    timestep = (256 * D + D) + (D * D + D)
    n_time = 3 + int(cfg.cfg_distilled) + int(cfg.use_meanflow)
    patch_embed = (9 * C * hid + hid) + _resblock(hid, D, D)
    final_layer = _resblock(D, hid, D) + 2 * hid + (9 * hid * C + C)
    return ParamCounts(
        layers=L, experts=E * sum(swiglu), attention=L * (D * (N + 2 * K) * H + N * H * D),
        shared=sum(s * n for s, n in zip(swiglu, cfg.num_shared_expert)), router=L * E * D,
        norms=L * (2 * D + 2 * H) + D, wte=cfg.vocab_size * D, lm_head=cfg.vocab_size * D,
        image_io=patch_embed + final_layer + n_time * timestep, vae=VAE_PARAMS)


# ------------------------------------------------------------------ the estimate


@dataclass(frozen=True)
class Part:
    """One module group's weights on one device."""

    name: str
    params: int  # whole model
    bytes_per_param: float
    split: int  # the group is divided over this many ranks (1 = replicated)
    how: str  # what the split is, in words
    device_bytes: float
    host_bytes: float = 0.0
    note: str = ""


@dataclass(frozen=True)
class Estimate:
    parts: tuple[Part, ...]
    kv_bytes: int
    kv_token_bytes: int  # per token of a row, this device's share
    act_tokens: int
    act_bytes: float
    memory_bytes: float  # device.memory_limit_gib, else device.memory_gib (0 = not stated)
    streamed_bytes: float  # copied host -> device per forward (offload.mode layers / experts)

    @property
    def weight_bytes(self) -> float:
        return sum(p.device_bytes for p in self.parts)

    @property
    def host_bytes(self) -> float:
        return sum(p.host_bytes for p in self.parts)

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.memory_bytes - self.total_bytes

    @property
    def verdict(self) -> str:
        """``fits``, ``tight`` (under the reserve), ``does not fit``, or ``not stated``."""
        if not self.memory_bytes:
            return "not stated"
        if self.headroom_bytes >= RESERVE_GIB * GiB:
            return "fits"
        return "tight" if self.headroom_bytes >= 0 else "does not fit"


def kv_heads_per_rank(cfg, degrees: Degrees) -> int:
    """KV heads one rank's pool stores (as ``ParallelRuntime.pool_kv_heads``)."""
    heads, kv = cfg.num_attention_heads // degrees.tp, cfg.num_key_value_heads // degrees.tp
    u = degrees.ulysses
    if u == 1:
        return kv
    if heads % u or (kv % u and u % kv):
        raise MeshError(f"parallel.ulysses={u} does not split {heads} query / {kv} kv heads per tp rank")
    return kv // u if kv % u == 0 else 1


def weight_parts(recipe: Recipe, counts: ParamCounts) -> tuple[list[Part], float]:
    """Per-device weights of every module group, and the bytes streamed per forward."""
    parts, streamed = _layer_parts(recipe, counts.layers, _layer_groups(recipe, counts))
    parts += _replicated_parts(recipe, counts)
    parts.append(_vae_part(recipe, counts))
    return parts, streamed


def _layer_groups(recipe: Recipe, counts: ParamCounts) -> list[tuple]:
    """``(name, params, bytes/param, split, how)`` of each module group inside the decoder layers."""
    d = Degrees.from_recipe(recipe.parallel)
    layout = expert_layout(d, 0)
    act = DTYPE_BYTES[recipe.model.dtype]
    qbytes = QUANT_BYTES.get(recipe.quant.scheme, act)
    dense_q = act if recipe.quant.experts_only else qbytes
    return [
        ("routed experts", counts.experts, qbytes, layout.groups * layout.expert_tp, _expert_split_words(layout)),
        ("attention (qkv_proj, o_proj)", counts.attention, dense_q, d.tp, f"heads over tp {d.tp}"),
        ("shared experts", counts.shared, dense_q, d.tp, f"intermediate dim over tp {d.tp}"),
        ("router (fp32)", counts.router, 4, 1, "replicated"),
        ("norms", counts.norms, act, 1, "replicated"),
    ]


def _expert_split_words(layout) -> str:
    how = [f"{layout.groups} groups of whole experts"] if layout.groups > 1 else []
    how += [f"intermediate dim over {layout.expert_tp}"] if layout.expert_tp > 1 else []
    return " x ".join(how)


def _layer_parts(recipe: Recipe, layers: int, groups: list[tuple]) -> tuple[list[Part], float]:
    """The decoder-layer groups on one device, and the bytes streamed per forward."""
    parts, streamed = [], 0.0
    for name, params, bpp, split, how in groups:
        part = Part(name, params, bpp, split, how, params * bpp / split)
        if _is_streamed(recipe.offload.mode, name):
            part = _streamed_part(part, recipe.offload, layers)
            streamed += part.host_bytes
        parts.append(part)
    return parts, streamed


def _is_streamed(offload_mode: str, group: str) -> bool:
    """Whether ``offload.mode`` streams this decoder-layer group in from the host layer by layer."""
    return offload_mode == "layers" or (offload_mode == "experts" and group == "routed experts")


def _streamed_part(part: Part, offload, layers: int) -> Part:
    """``part`` with resident layers and prefetch slots on the device, the other layers on the host."""
    resident = min(offload.resident_layers, layers)
    slots = min(offload.prefetch_window, layers - resident)
    per_layer = part.device_bytes / layers
    note = f"{resident} resident + {slots} prefetch slots of {layers}; {layers - resident} layers on the host"
    return replace(part, device_bytes=per_layer * (resident + slots),
                   host_bytes=per_layer * (layers - resident), note=note)


def _replicated_parts(recipe: Recipe, counts: ParamCounts) -> list[Part]:
    """wte and lm_head (in pinned host memory under ``offload.mode text``) and the image I/O heads."""
    act = DTYPE_BYTES[recipe.model.dtype]
    text_host = recipe.offload.mode == "text"
    groups = [("wte", counts.wte, text_host), ("lm_head", counts.lm_head, text_host),
              ("image I/O (patch_embed, final_layer, timestep MLPs)", counts.image_io, False)]
    return [_replicated_part(name, params, act, on_host) for name, params, on_host in groups]


def _replicated_part(name: str, params: int, bpp: float, on_host: bool) -> Part:
    size = float(params * bpp)
    if on_host:
        return Part(name, params, bpp, 1, "replicated", 0.0, size, "pinned host memory (offload.mode text)")
    return Part(name, params, bpp, 1, "replicated", size)


def _vae_part(recipe: Recipe, counts: ParamCounts) -> Part:
    """The VAE decoder, whole on every device (its peak while ``offload.mode vae`` streams it in).

    Its weights stay float32 whatever ``model.vae_dtype`` says: that field is the autocast dtype of the
    decode (the official pipeline's ``vae_autocast_dtype``), so it changes activations, not weights.
    """
    streamed = recipe.offload.mode == "vae"
    note = "decoder streamed in for the decode (offload.mode vae); peak shown" if streamed else ""
    bpp = DTYPE_BYTES["float32"]
    return Part(f"VAE (float32, decode in {recipe.model.vae_dtype})", counts.vae, bpp, 1, "replicated",
                counts.vae * bpp, 0.0, note)


def kv_token_bytes(recipe: Recipe, cfg) -> int:
    """Bytes of K and V, all layers, for one token of a row in this device's pool."""
    heads = kv_heads_per_rank(cfg, Degrees.from_recipe(recipe.parallel))
    return 2 * cfg.num_hidden_layers * heads * cfg.head_dim * DTYPE_BYTES[recipe.model.dtype]


def activation_bytes(recipe: Recipe, cfg) -> tuple[int, float]:
    """``(T, A)``: tokens of one forward on a device and the activation estimate (see the module docstring).

    ``4 D``: residual stream, normed input, attention output, MoE output; ``W_qkv =
    (N + 2K) H / tp``: this rank's packed q/k/v; ``r = topk x dispatch / expert
    groups`` routed rows per token on this rank (balanced routing), each with the
    gathered input and the expert output (``2 D``) and the gate/up and SwiGLU
    intermediates (``3 I_loc``, ``I_loc = I / expert_tp``); ``b`` = bytes of model.dtype.
    """
    d = Degrees.from_recipe(recipe.parallel)
    layout = expert_layout(d, 0)
    D, H = cfg.hidden_size, cfg.head_dim
    tokens = math.ceil(recipe.serving.max_batch_tokens / (d.cfg * d.ulysses * d.ring))
    w_qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * H // d.tp
    rows = max(cfg.moe_topk) * layout.dispatch / layout.groups
    i_loc = max(cfg.moe_intermediate_size) // layout.expert_tp
    per_token = 4 * D + w_qkv + rows * (2 * D + 3 * i_loc)
    return tokens, tokens * DTYPE_BYTES[recipe.model.dtype] * per_token


def estimate(recipe: Recipe, cfg=None) -> Estimate:
    """The per-device memory estimate of ``recipe`` for its flavour's released model (or ``cfg``)."""
    cfg = cfg or released_config(recipe.model.flavor)
    parts, streamed = weight_parts(recipe, param_counts(cfg))
    kv_token = kv_token_bytes(recipe, cfg)
    tokens, act = activation_bytes(recipe, cfg)
    usable = recipe.device.memory_limit_gib or recipe.device.memory_gib  # a capped share of the card
    return Estimate(tuple(parts), recipe.kv_cache.budget_bytes, kv_token, tokens, act, usable * GiB, streamed)
