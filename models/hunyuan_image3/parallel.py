"""HunyuanImage-3.0's parallel plan, as data: module-FQN glob -> sharding style.

``omni.parallel.tp.apply_plan`` executes it for each rank (module swaps,
all-reduce hooks, sliced checkpoint reads); the model code stays
single-device. The recipe picks the degrees (tp, ep, ulysses, ring, cfg, dp).

Per decoder layer with tp ranks (collectives: two all-reduces over tp, one
after attention and one after the MoE; with ep > tp also the expert
all-to-all; with Ulysses four all-to-alls around attention):

    qkv_proj   column-parallel by whole KV groups: the rows are packed per KV
               group as [q x N/K, k, v], so rank r takes groups r*K/tp ..
               (r+1)*K/tp - 1 -- one contiguous row block -- and the query heads
               of those groups. tp must divide K (8 in the released model):
               tp > K would need KV groups replicated over ranks; it is refused.
    o_proj     row-parallel over the same heads; all-reduce.
    MoE        shared expert: gate_and_up column-parallel (each of the [gate |
               up] halves split), down_proj row-parallel; routed experts: the
               same split of each expert's intermediate dim over ``expert_tp``
               ranks, and the experts themselves over the ep groups; ONE
               all-reduce for shared + routed parts (``ReduceOutput`` on mlp).
"""
from __future__ import annotations

from omni.parallel.styles import (
    Colwise, Experts, Heads, ReduceOutput, Replicate, Rowwise, SequenceParallel,
)

TP_PLAN = {
    # ---- sharded
    "model.layers.*.self_attn": Heads(heads="num_attention_heads", kv_heads="num_key_value_heads"),
    "model.layers.*.self_attn.qkv_proj": Colwise(blocks="num_key_value_heads", whole_blocks=True),
    "model.layers.*.self_attn.o_proj": Rowwise(reduce=True),
    "model.layers.*.mlp.shared_mlp.gate_and_up_proj": Colwise(blocks=2),
    "model.layers.*.mlp.shared_mlp.down_proj": Rowwise(reduce=False),
    "model.layers.*.mlp.experts": Experts(count="num_experts"),
    "model.layers.*.mlp.experts.gate_and_up_proj": Colwise(blocks=2, axis="expert_tp"),
    "model.layers.*.mlp.experts.down_proj": Rowwise(reduce=False, axis="expert_tp"),
    "model.layers.*.mlp": ReduceOutput(axis="tp"),
    # ---- replicated, deliberately
    "model.layers.*.self_attn.query_layernorm": Replicate("per-head RMSNorm over head_dim: "
                                                          "same weights for every head"),
    "model.layers.*.self_attn.key_layernorm": Replicate("per-head RMSNorm over head_dim: same weights for every head"),
    "model.layers.*.input_layernorm": Replicate("RMSNorm over the full hidden size (activations are replicated)"),
    "model.layers.*.post_attention_layernorm": Replicate("RMSNorm over the full hidden size"),
    "model.layers.*.mlp.gate": Replicate("router: 4096 x 64 fp32; every rank needs every token's top-k choice"),
    "model.wte": Replicate("embedding lookup: 1 GiB in bf16, read once per token; a vocab split would need "
                           "an all-reduce for a trivial gain"),
    "model.ln_f": Replicate("text head only"),
    "lm_head": Replicate("text logits (AR stage only); kept whole so greedy decoding needs no gather"),
    "timestep_emb": Replicate("image I/O: tiny MLPs"),
    "time_embed": Replicate("image I/O: tiny MLPs"),
    "time_embed_2": Replicate("image I/O: tiny MLPs"),
    "guidance_emb": Replicate("Distil only: tiny MLP"),
    "timestep_r_emb": Replicate("Distil only: tiny MLP"),
    "patch_embed": Replicate("image I/O: convolutions over the latent grid (every rank builds the whole block)"),
    "final_layer": Replicate("image I/O: convolutions need the whole latent grid (hidden states are gathered)"),
}

# Sequence parallelism (ulysses or ring): the attention kernels are wrapped; everything else is per token.
SP_PLAN = {
    "model.layers.*.self_attn": SequenceParallel(kernels="attn", heads="num_attention_heads",
                                                 kv_heads="num_key_value_heads", head_dim="head_dim"),
}

PLANS = (TP_PLAN, SP_PLAN)


def plans_for(fuse_shared_expert: bool) -> tuple[dict, dict]:
    """``PLANS``, less the shared expert's entries when it is fused into the routed experts' stack (its slice then
    follows the ``experts`` entries: the same column / row split)."""
    if not fuse_shared_expert:
        return PLANS
    return tuple({k: v for k, v in plan.items() if ".shared_mlp." not in k} for plan in PLANS)
