"""HunyuanImage-3.0 transformer: one MoE decoder that writes text and denoises image latents.

Hunyuan-A13B's decoder (pre-norm RMSNorm, GQA attention with QK-norm, a MoE
MLP of 64 routed SwiGLU experts, top 8, plus one shared expert) with image
heads. Image latent tokens sit in the token stream; the attention context
decides who sees whom (text causal, the ``<img>`` run bidirectional).

    h   = x + o_proj(Attn(QKNorm(RoPE(qkv_proj(RMSNorm(x))))))
    out = h + shared_mlp(RMSNorm(h)) + sum_k w_k expert_k(RMSNorm(h))
    text:  logits   = lm_head(ln_f(h_L))          (ln_f only here)
    image: velocity = final_layer(h_L[<img>], time_embed_2(t))

Everything is packed: ``T`` counts all tokens of all sequences in the batch
(no batch dim), and the attention context (``ctx.mask``, ``ctx.keys_values``)
carries where each sequence starts and what it may see. Every GEMM and the
attention run through kernels the platform resolved at build time.

Parameter names equal the official checkpoint names except for the stacked
routed experts (``checkpoint_names``). Pre-quantized FP8 checkpoints (ModelOpt)
add ``*.weight_scale`` / ``*.input_scale`` beside each quantized weight;
``prepare_prequantized()`` declares the buffers they load into, and
``finalize()`` adopts the e4m3 weights as they are.

Shape suffixes: T packed tokens, S keys visible to them, D model width,
N query heads, K kv heads, H head dim, E experts, k experts per token,
R = T*k routed rows, I expert width, V vocab, B images, C latent channels,
h/w latent rows/cols.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from omni.build_options import BuildOptions
from omni.group_norm import use_group_norm_kernel
from omni.winograd import use_conv3x3_kernel
from omni.layers import (GroupedLinear, KernelOwner, Linear, declare_prequantized, embedding, finalize_all,
                         finalize_experts, unhooked)
from omni.specs import (GROUPED_SKINNY_ROWS, GROUPED_SMALL_ROWS, PDL_ROWS, GlueSpec, MoESpec, PreparedMoE,
                        PreparedWeight, RowQuantized)
from omni.streams import INLINE

from . import checkpoint_names
from .config import HunyuanImage3Config
from .image_io import TimestepEmbedder, UNetDown, UNetUp, to_channels_last

MASKS = ("none", "causal", "dense")



def glue_spec(cfg: HunyuanImage3Config, layer_idx: int, opts: BuildOptions) -> GlueSpec:
    """The memory-bound steps of one decoder layer (norms, residual, RoPE + QK-norm, SwiGLU, routing)."""
    return GlueSpec(hidden=cfg.hidden_size, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, dtype=opts.dtype,
                    topk=min(cfg.moe_topk[layer_idx], cfg.num_experts), memory_bound=opts.memory_bound,
                    capturable=opts.capturable, pdl_rows=opts.pdl_rows, always_on=int(opts.fuse_shared_expert))


def takes_rows(linear: Linear) -> bool:
    """Whether ``linear`` takes rows quantized by a glue kernel (an fp8_row kernel that says so)."""
    return linear.spec.quant == "fp8_row" and getattr(linear.kernel, "accepts_row_quantized", False)


class RMSNorm(nn.Module):
    """``weight * (x * rsqrt(mean(x^2) + eps))``; normalised in fp32, rounded before the weight (``glue``)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, glue=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps, self.glue = eps, glue  # glue: None for the per-head QK-norms (run inside rope_qk_norm)

    def forward(self, x: torch.Tensor, quantize: bool = False):
        return self.glue.rms_norm(x, self.weight, quantize)


# ---------------------------------------------------------------- attention


class Attention(nn.Module):
    """GQA attention; RoPE first, then per-head RMSNorm on q and k."""

    def __init__(self, cfg: HunyuanImage3Config, layer_idx: int, *, platform, opts: BuildOptions):
        super().__init__()
        D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer_idx, self.shape_NKH = layer_idx, (N, K, H)
        kw = dict(platform=platform, **opts.linear_kw(opts.dense_quant))
        self.qkv_proj = Linear(D, (N + 2 * K) * H, **kw)
        self.o_proj = Linear(N * H, D, **kw)
        self.query_layernorm = RMSNorm(H, cfg.rms_norm_eps, opts.dtype)
        self.key_layernorm = RMSNorm(H, cfg.rms_norm_eps, opts.dtype)
        self.attn = {mask: platform.attention(opts.attention_spec(N, K, H, mask)) for mask in MASKS}
        self.glue = platform.glue(glue_spec(cfg, layer_idx, opts))

    def forward(self, x_TD, cos_TH, sin_TH, ctx) -> torch.Tensor:
        """``x_TD``: the normed rows (or their ``RowQuantized`` form for an fp8_row ``qkv_proj``)."""
        N, K, _ = self.shape_NKH
        q_TNH, k_TKH, v_TKH = self.glue.rope_qk_norm(self.qkv_proj(x_TD), cos_TH, sin_TH, self.query_layernorm.weight,
                                                     self.key_layernorm.weight, (N, K))
        k_all, v_all, meta = ctx.keys_values(self.layer_idx, k_TKH, v_TKH)
        o_TNH = self.attn[ctx.mask](q_TNH, k_all, v_all, meta)
        return self.o_proj(o_TNH.flatten(1))


# ---------------------------------------------------------------- mixture of experts


class SwiGLU(nn.Module):
    """The shared expert: ``down(swiglu(gate_and_up(x)))``."""

    def __init__(self, dim: int, inner: int, *, platform, glue, **linear_kw):
        super().__init__()
        self.gate_and_up_proj = Linear(dim, 2 * inner, platform=platform, **linear_kw)
        self.down_proj = Linear(inner, dim, platform=platform, **linear_kw)
        self.glue = glue

    def forward(self, x_TD) -> torch.Tensor:
        a_TI = self.glue.swiglu(self.gate_and_up_proj(x_TD), takes_rows(self.down_proj))
        return self.down_proj(a_TI)


class Router(nn.Module):
    """``wg`` in fp32; softmax over all experts, top-k, renormalised to sum 1."""

    def __init__(self, dim: int, num_experts: int, topk: int, *, platform, glue):
        super().__init__()
        self.wg = Linear(dim, num_experts, platform=platform, dtype=torch.float32)
        self.topk, self.glue = topk, glue  # glue.route: softmax, top-k, renormalise in one pass

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.glue.route(self.wg(x_TD))  # the linear computes in fp32 (its spec.dtype)


def expert_offsets(expert_R: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 cumulative row ends per expert, on the device (scatter_add: no host sync)."""
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_R.device)
    counts_E.scatter_add_(0, expert_R, torch.ones_like(expert_R))
    return counts_E.cumsum(0).to(torch.int32)


class RoutedExperts(KernelOwner):
    """All experts' SwiGLUs through the platform's fused MoE (``omni_moe_impl``).

    The weights stay two ``GroupedLinear`` modules (checkpoint names, TP/EP
    plans and the offloader see them as before); ``finalize()`` prepares both
    with the MoE kernel and the forward hands them to it. ``topk``: the k of the
    ids it is fed (an EP shard feeds single assignments and sets it to 1).
    """

    def __init__(self, num_experts: int, dim: int, inner: int, *, platform, dtype, quant, memory_bound,
                 fast_accum: bool = False, grouped_fp8: str = "auto", small_rows: int = GROUPED_SMALL_ROWS,
                 skinny_rows: int = GROUPED_SKINNY_ROWS, pdl_rows: int = PDL_ROWS, topk: int = 1,
                 capturable: bool = False):
        super().__init__()
        kw = dict(platform=platform, dtype=dtype, quant=quant, fast_accum=fast_accum, grouped_fp8=grouped_fp8,
                  small_rows=small_rows)
        self.gate_and_up_proj = GroupedLinear(num_experts, dim, 2 * inner, **kw)
        self.down_proj = GroupedLinear(num_experts, inner, dim, **kw)
        self.platform, self.topk, self.memory_bound, self.capturable = platform, topk, memory_bound, capturable
        self.skinny_rows, self.pdl_rows = skinny_rows, pdl_rows  # the MoE's own (no GroupedLinear uses them)
        self.moe = platform.moe(self._spec())

    def _spec(self) -> MoESpec:
        """From the weights' current sizes: a parallel plan may keep fewer experts or a slice of ``inner``."""
        g13 = self.gate_and_up_proj.spec
        return MoESpec(num_experts=g13.num_experts, topk=min(self.topk, g13.num_experts), hidden=g13.in_features,
                       inner=self.down_proj.spec.in_features, dtype=g13.dtype, quant=g13.quant,
                       memory_bound=self.memory_bound, capturable=self.capturable, fast_accum=g13.fast_accum,
                       grouped_fp8=g13.grouped_fp8, small_rows=g13.small_rows, skinny_rows=self.skinny_rows,
                       pdl_rows=self.pdl_rows)

    @property
    def num_experts(self) -> int:  # read off the weights: a plan may keep only some experts on a rank
        return self.gate_and_up_proj.spec.num_experts

    def finalize(self) -> None:
        """Prepare both expert weights for the MoE kernel (once, after loading); pre-quantized ones are adopted."""
        if self.gate_and_up_proj.prepared is not None and self.down_proj.prepared is not None:
            return
        if self._spec() != self.moe_spec:
            self.moe = self.platform.moe(self._spec())
        finalize_experts(self.moe, self.gate_and_up_proj, self.down_proj)

    @property
    def moe_spec(self) -> MoESpec:
        return self.moe.spec

    @property
    def takes_rows(self) -> bool:
        """Whether the MoE kernel takes rows the glue quantized (``RowQuantized``) and gathers them as they are."""
        return self.moe_spec.quant == "fp8_row" and getattr(self.moe, "accepts_row_quantized", False)

    @property
    def takes_addends(self) -> bool:
        """Whether the MoE kernel adds other terms in its fp32 combine (``accepts_addends``) and no plan hook
        stands between it and the caller (expert parallelism combines the routed rows after a dispatch)."""
        return getattr(self.moe, "accepts_addends", False) and unhooked(self)

    def forward(self, x_TD: torch.Tensor, weights_Tk: torch.Tensor, experts_Tk: torch.Tensor,
                addends=()) -> torch.Tensor:
        """The routed experts' weighted sum; ``addends`` (only where ``takes_addends``; a tuple, or a callable the
        kernel calls right before its combine reads them) join its fp32 combine."""
        g13, g2 = self.gate_and_up_proj, self.down_proj
        prepared = PreparedMoE(g13.prepared or PreparedWeight(g13.weight), g2.prepared or PreparedWeight(g2.weight))
        if addends:
            return self.moe(x_TD, weights_Tk, experts_Tk, prepared, addends=addends)
        return self.moe(x_TD, weights_Tk, experts_Tk, prepared)


class MoE(nn.Module):
    """``shared_mlp(x) + sum_k w_k expert_k(x)`` (the shared expert is always added).

    With ``kernels.fuse_shared_expert`` the shared expert is the routed experts' last group, ``E`` (its
    checkpoint tensors load there, ``HunyuanImage3Transformer.param_name_for``), and the router gives every
    token that id with weight 1 (``GlueSpec.always_on``): one MoE call computes ``sum_k w_k expert_k(x) +
    expert_E(x)``, the same function with the shared expert's GEMMs inside the grouped ones.
    """

    def __init__(self, cfg: HunyuanImage3Config, layer_idx: int, *, platform, opts: BuildOptions):
        super().__init__()
        D, inner, E = cfg.hidden_size, cfg.moe_intermediate_size[layer_idx], cfg.num_experts
        glue = platform.glue(glue_spec(cfg, layer_idx, opts))
        self.gate = Router(D, E, cfg.moe_topk[layer_idx], platform=platform, glue=glue)
        fused = int(fused_shared(cfg, layer_idx, opts))
        self.shared_mlp = None if fused else SwiGLU(D, inner * cfg.num_shared_expert[layer_idx], platform=platform,
                                                    glue=glue, **opts.linear_kw(opts.dense_quant))
        self.experts = RoutedExperts(E + fused, D, inner, platform=platform, topk=cfg.moe_topk[layer_idx] + fused,
                                     capturable=opts.capturable, **opts.expert_kw())
        self.side = platform.side_stream() if opts.shared_expert_stream else INLINE
        self._shared_runner = None  # where the shared expert runs: decided at the first forward (``_beside``)

    def forward(self, n_TD, residual_TD: torch.Tensor | None = None) -> torch.Tensor:
        """``n_TD``: the normed rows, or their ``RowQuantized`` form (the shared expert, and the routed experts
        where their kernel says so, take it as is). ``residual_TD``, if given, is added to the output: inside
        the routed experts' combine with the shared expert's output where the kernel takes addends."""
        x_TD = n_TD.x_TI if isinstance(n_TD, RowQuantized) else n_TD
        shared = None if self.shared_mlp is None else self._beside().run(self.shared_mlp, n_TD)  # joined later
        weights_Tk, experts_Tk = self.gate(x_TD)  # fused: the shared expert's id is the last column
        routed_in = n_TD if isinstance(n_TD, RowQuantized) and self.experts.takes_rows else x_TD

        def terms() -> tuple:
            own = () if shared is None else (shared.join(),)
            return own if residual_TD is None else (residual_TD, *own)

        if self.experts.takes_addends:
            return self.experts(routed_in, weights_Tk, experts_Tk, addends=terms)
        y_TD = self.experts(routed_in, weights_Tk, experts_Tk)
        for a in reversed(terms()):  # h + (shared + routed): the official order of the adds
            y_TD = a + y_TD
        return y_TD

    def _beside(self):
        """Where the shared expert runs: the side stream (``kernels.shared_expert_stream``) unless a parallel plan
        hooks it (its collectives keep to the current stream), else inline. The plan's hooks are attached at
        build, before any forward, so the first forward decides for all."""
        if self._shared_runner is None:  # (never called when the shared expert is fused)
            hooked = not all(unhooked(m) for m in self.shared_mlp.modules())
            self._shared_runner = INLINE if hooked else self.side
        return self._shared_runner

    @property
    def takes_rows(self) -> bool:
        """Whether the MLP's first GEMMs take the glue's e4m3 rows (``RowQuantized``) as they are."""
        mlp = self.shared_mlp
        return self.experts.takes_rows if mlp is None else takes_rows(mlp.gate_and_up_proj)


def fused_shared(cfg: HunyuanImage3Config, layer_idx: int, opts: BuildOptions) -> bool:
    """``kernels.fuse_shared_expert`` for this layer; one shared expert of the routed experts' width is needed."""
    if opts.fuse_shared_expert and cfg.num_shared_expert[layer_idx] != 1:
        raise ValueError(f"kernels.fuse_shared_expert needs one shared expert per layer, layer {layer_idx} has "
                         f"{cfg.num_shared_expert[layer_idx]}")
    return opts.fuse_shared_expert


# ---------------------------------------------------------------- decoder


class DecoderLayer(nn.Module):
    """Pre-norm attention and MoE; the norms, the first residual add and the fp8 row quantization of
    their outputs run as the platform's fused glue (``omni_glue_impl``)."""

    def __init__(self, cfg: HunyuanImage3Config, layer_idx: int, *, platform, opts: BuildOptions):
        super().__init__()
        self.glue = glue = platform.glue(glue_spec(cfg, layer_idx, opts))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.dtype, glue)
        self.self_attn = Attention(cfg, layer_idx, platform=platform, opts=opts)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.dtype, glue)
        self.mlp = MoE(cfg, layer_idx, platform=platform, opts=opts)

    def forward(self, x_TD, cos_TH, sin_TH, ctx) -> torch.Tensor:
        n_TD = self.input_layernorm(x_TD, takes_rows(self.self_attn.qkv_proj))
        a_TD = self.self_attn(n_TD, cos_TH, sin_TH, ctx)
        h_TD, n_TD = self.glue.add_rms_norm(x_TD, a_TD, self.post_attention_layernorm.weight, self.mlp.takes_rows)
        if unhooked(self.mlp):  # the residual joins the MoE's combine; a plan's all-reduce must see the MLP alone
            return self.mlp(n_TD, residual_TD=h_TD)
        return h_TD + self.mlp(n_TD)


class Decoder(nn.Module):
    """The ``model.`` part of the checkpoint: ``wte``, ``layers``, ``ln_f``."""

    def __init__(self, cfg: HunyuanImage3Config, *, platform, opts: BuildOptions):
        super().__init__()
        self.wte = embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id, dtype=opts.dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, platform=platform, opts=opts)
                                    for i in range(cfg.num_hidden_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts.dtype, platform.glue(glue_spec(cfg, 0, opts)))


class HunyuanImage3Transformer(nn.Module):
    """Backbone, text head and image I/O heads; inference only (no grads)."""

    def __init__(self, cfg: HunyuanImage3Config, platform, opts: BuildOptions):
        super().__init__()
        self.cfg, self.dtype = cfg, opts.dtype
        D, C, hidden = cfg.hidden_size, cfg.latent_channels, cfg.patch_embed_hidden_dim
        kw = dict(platform=platform, dtype=opts.dtype)
        self.model = Decoder(cfg, platform=platform, opts=opts)
        self.lm_head = Linear(D, cfg.vocab_size, **kw)  # kept unquantized: logits quality
        self.timestep_emb = TimestepEmbedder(D, **kw)  # replaces the <timestep> token
        self.time_embed = TimestepEmbedder(D, **kw)  # conditions patch_embed
        self.time_embed_2 = TimestepEmbedder(D, **kw)  # conditions final_layer
        if cfg.cfg_distilled:
            self.guidance_emb = TimestepEmbedder(D, **kw)  # replaces the <guidance> token
        if cfg.use_meanflow:
            self.timestep_r_emb = TimestepEmbedder(D, **kw)  # replaces the <timestep_r> token
        self.patch_embed = UNetDown(C, hidden, D, patch_size=cfg.patch_size, **kw)
        self.final_layer = UNetUp(D, hidden, C, patch_size=cfg.patch_size, **kw)
        self.channels_last = "channels_last" in platform.info.capabilities  # NHWC conv weights at finalize()
        # the glue's optional kernels, where the platform has them: the KV pool's fused store + gather (gathered
        # keys), the one-pass "GroupNorm [, FiLM], SiLU" of the image heads and the VAE, and the heads' 3x3
        # convolutions by Winograd (conv3x3 / conv3x3_weights, taken at finalize())
        glue = platform.glue(glue_spec(cfg, 0, opts))
        self.kv_store_gather = getattr(glue, "store_gather_kv", None)
        self.group_norm_kernel = getattr(glue, "group_norm", None)
        self.image_glue = glue
        self.requires_grad_(False)

    # ------------------------------------------------------------ token stream

    def embed_tokens(self, ids_T: torch.Tensor) -> torch.Tensor:
        """Rows of ``wte``, gathered where the table lives (it may be offloaded to the host)."""
        table = self.model.wte.weight
        return self.model.wte(ids_T.to(table.device)).to(ids_T.device)

    def timestep_token(self, t_B: torch.Tensor) -> torch.Tensor:
        """Embedding of the ``<timestep>`` token for t on the 0..1000 scale, ``[B, D]``."""
        return self.timestep_emb(t_B)

    def guidance_token(self, scale_B: torch.Tensor) -> torch.Tensor:
        """Distil only: embedding of the ``<guidance>`` token; input 1000 * scale rounded through bf16, as the
        official pipeline builds it (5.0 -> 4992)."""
        return self.guidance_emb((1000 * scale_B).to(torch.bfloat16).float())

    def timestep_r_token(self, r_B: torch.Tensor) -> torch.Tensor:
        """Distil / MeanFlow only: embedding of the ``<timestep_r>`` token (the next timestep)."""
        return self.timestep_r_emb(r_B)

    def image_tokens(self, latents_BChw: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
        """``patch_embed`` conditioned on ``time_embed(t)``: ``[B, h*w, D]``, row-major."""
        return self.patch_embed(latents_BChw.to(self.dtype), self.time_embed(t_B))

    # ------------------------------------------------------------ backbone and heads

    def backbone(self, x_TD: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor, ctx) -> torch.Tensor:
        """All decoder layers over packed tokens; no ``ln_f`` (the image head reads this directly)."""
        for layer in self.model.layers:
            x_TD = layer(x_TD, cos_TH, sin_TH, ctx)
        return x_TD

    def text_logits(self, h_TD: torch.Tensor) -> torch.Tensor:
        """``lm_head(ln_f(h))`` in fp32, ``[T, V]``."""
        h_TD = self.model.ln_f(h_TD)
        return self.lm_head(h_TD.to(self.lm_head.weight.device)).float().to(h_TD.device)

    def velocity(self, h_BhwD: torch.Tensor, t_B: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """``final_layer`` on the image tokens' last hidden states, conditioned on ``time_embed_2(t)``; fp32."""
        return self.final_layer(h_BhwD, self.time_embed_2(t_B), h, w).float()

    # ------------------------------------------------------------ checkpoint names (checkpoint_names.py)

    def official_names(self) -> Iterator[str]:
        """Every checkpoint name this module owns (per-expert names for the stacked experts)."""
        return checkpoint_names.official_names(self)

    def param_name_for(self, official_name: str) -> tuple[str, int | None]:
        """(this module's parameter, index into its stacked expert dim or None) for a checkpoint name."""
        return checkpoint_names.param_name_for(self, official_name)

    def prepare_prequantized(self) -> int:
        """Before loading a pre-quantized FP8 checkpoint: declare its scale buffers (``omni.layers``)."""
        return declare_prequantized(self)

    def finalize(self) -> None:
        """Prepare every kernel-backed weight (quantize, re-layout) once, after loading."""
        finalize_all(self)
        if self.channels_last:
            to_channels_last(self.patch_embed, self.final_layer)
        if self.group_norm_kernel is not None:
            use_group_norm_kernel(self.group_norm_kernel, self.patch_embed, self.final_layer)
        use_conv3x3_kernel(self.image_glue, self.patch_embed, self.final_layer)

