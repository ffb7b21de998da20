"""Golden tests: the from-scratch HunyuanImage-3.0 transformer against the official code.

The reference tensors in ../shared/golden were produced on the CPU in float32 by
the official HunyuanImage3ForCausalMM (Tencent-Hunyuan/HunyuanImage-3.0, commit
1d011c84; sdpa attention, eager MoE) with the tiny config and seeded weights.
Golden rows are [cond, uncond] CFG pairs; here both rows are packed into one
token stream (T = 2L) with a block-diagonal dense mask, the way the engine
batches requests of different lengths.

Shape suffixes: B rows, L row length, T packed tokens, S keys, D width,
K kv heads, H head dim, Q step tokens per row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from golden_utils import fp32_bound
from omni.attention_context import DenseContext, dense_meta
from omni.build_options import BuildOptions
from omni.platform_manager import select
from omni.specs import VarlenMeta
from omni.models.hunyuan_image3.config import TINY_GOLDEN, HunyuanImage3Config
from omni.models.hunyuan_image3.rope import image_positions, rope_cos_sin, text_positions
from omni.models.hunyuan_image3.sampler import cfg_combine, euler_step
from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
from omni.models.hunyuan_image3.checkpoint_names import FOREIGN_PREFIXES, load_state

from golden_utils import GOLDEN_DIR
GOLDEN_JSON = GOLDEN_DIR / "hunyuan_image3_tiny.json"
GOLDEN_TENSORS = GOLDEN_DIR / "hunyuan_image3_tiny.safetensors"
ATOL = 1e-5
GUIDANCE = 5.0


@pytest.fixture(scope="module")
def golden():
    """(golden json, every stored tensor). Skips if the golden files are absent."""
    if not (GOLDEN_JSON.is_file() and GOLDEN_TENSORS.is_file()):
        pytest.skip(f"golden data not found in {GOLDEN_DIR} (expected ../shared/golden beside the repo)")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    return json.loads(GOLDEN_JSON.read_text()), safetensors_torch.load_file(str(GOLDEN_TENSORS))


@pytest.fixture(scope="module")
def g(golden):
    return {k.removeprefix("golden."): v for k, v in golden[1].items() if k.startswith("golden.")}


@pytest.fixture(scope="module")
def weights(golden):
    return {k: v for k, v in golden[1].items() if not k.startswith("golden.")}


@pytest.fixture(scope="module")
def model(golden, weights):
    cfg = HunyuanImage3Config.from_json_dict(golden[0]["tiny_config"])
    m = HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=torch.float32))
    load_state(m, weights)
    m.finalize()
    return m.eval()


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = (got.float() - want.float()).abs().max().item()
    print(f"{name}: max abs err {err:.3g}")
    assert err <= fp32_bound(want, ATOL), f"{name}: max abs err {err} > {fp32_bound(want, ATOL)}"
    return err


# ---------------------------------------------------------------- contexts


@dataclass
class RecordingContext(DenseContext):
    """Full-sequence dense context that also keeps every layer's K/V (the step-1 cache)."""

    kv: dict = field(default_factory=dict)

    def keys_values(self, layer, k_TKH, v_TKH):
        self.kv[layer] = (k_TKH, v_TKH)
        return super().keys_values(layer, k_TKH, v_TKH)


@dataclass
class CachedStepContext:
    """Later denoising step: step tokens overwrite their slots of the step-1 K/V, then attend densely."""

    cache: dict  # layer -> (k_BLKH, v_BLKH)
    positions_BQ: torch.Tensor
    meta: VarlenMeta
    mask: str = "dense"

    def keys_values(self, layer, k_TKH, v_TKH):
        B, Q = self.positions_BQ.shape
        rows_B1 = torch.arange(B)[:, None]
        out = []
        for cached_BLKH, new_TKH in zip(self.cache[layer], (k_TKH, v_TKH)):
            cached_BLKH = cached_BLKH.clone()
            cached_BLKH[rows_B1, self.positions_BQ] = new_TKH.view(B, Q, *new_TKH.shape[1:])
            out.append(cached_BLKH.flatten(0, 1))
        return out[0], out[1], self.meta


def varlen_meta(lengths: list[int]) -> VarlenMeta:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu_B1 = torch.tensor(cu, dtype=torch.int32)
    return VarlenMeta(cu_seqlens_q_B1=cu_B1, cu_seqlens_k_B1=cu_B1, max_seqlen_q=max(lengths),
                      max_seqlen_k=max(lengths), cu_seqlens_q_host=tuple(cu), cu_seqlens_k_host=tuple(cu))


# ---------------------------------------------------------------- helpers


def run_captured(model, x_TD, cos_TH, sin_TH, ctx):
    """Backbone output plus each layer's output and each router's logits (forward hooks)."""
    hidden, router = [], []
    hooks = [layer.register_forward_hook(lambda m, a, out: hidden.append(out)) for layer in model.model.layers]
    hooks += [layer.mlp.gate.wg.register_forward_hook(lambda m, a, out: router.append(out))
              for layer in model.model.layers]
    try:
        return model.backbone(x_TD, cos_TH, sin_TH, ctx), hidden, router
    finally:
        for hook in hooks:
            hook.remove()


def first_step_inputs(model, g, case: str):
    """Packed step-1 inputs of one golden case: embeddings, rope tables, block-diagonal mask."""
    ids_BL = g[f"{case}.input_ids"]
    B, L = ids_BL.shape
    t_B = g[f"{case}.timestep"]
    x_TD = model.embed_tokens(ids_BL.flatten())
    x_TD[g[f"{case}.gen_timestep_scatter_index"][:, 0] + L * torch.arange(B)] = model.timestep_token(t_B)
    x_TD[g[f"{case}.image_mask"].flatten()] = model.image_tokens(g[f"{case}.model_input_latents"], t_B).flatten(0, 1)
    cos_TH, sin_TH = rope_cos_sin(g[f"{case}.rope_pos_yx"].repeat(B, 1), model.cfg.head_dim, model.cfg.rope_theta)
    return x_TD, cos_TH, sin_TH, torch.block_diag(*g[f"{case}.attention_mask"][:, 0])


def image_velocity(model, g, case: str, h_TD: torch.Tensor) -> torch.Tensor:
    latents = g[f"{case}.model_input_latents"]
    B, _, h, w = latents.shape
    h_BhwD = h_TD[g[f"{case}.image_mask"].flatten()].view(B, h * w, -1)
    return model.velocity(h_BhwD, g[f"{case}.timestep"], h, w)


@pytest.fixture(scope="module")
def step1(model, g):
    """Step-1 results per case: (x_TD, h_TD, per-layer outputs, router logits, pred, recorded K/V)."""
    results = {}
    with torch.no_grad():
        for case in ("A", "B"):
            x_TD, cos_TH, sin_TH, mask_TS = first_step_inputs(model, g, case)
            ctx = RecordingContext(dense_meta(mask_TS))
            h_TD, hidden, router = run_captured(model, x_TD, cos_TH, sin_TH, ctx)
            results[case] = dict(x=x_TD, h=h_TD, hidden=hidden, router=router,
                                 pred=image_velocity(model, g, case, h_TD), kv=ctx.kv)
    return results


# ---------------------------------------------------------------- config, loading, rope


def test_config_matches_golden_tiny_config(golden):
    cfg = HunyuanImage3Config.from_json_dict(golden[0]["tiny_config"])
    assert cfg == TINY_GOLDEN
    assert cfg.head_dim == 16 and cfg.num_kv_groups == 2 and cfg.latent_channels == 4
    assert cfg.image_token_grid(1024, 1024) == (4, 4) and cfg.image_token_grid(896, 1152) == (3, 4)
    assert HunyuanImage3Config.released().image_token_grid(1024, 1024) == (64, 64)


def test_config_rejects_unknown_and_unsupported(golden):
    tiny = golden[0]["tiny_config"]
    with pytest.raises(ValueError, match="unknown config keys.*'not_a_key'"):
        HunyuanImage3Config.from_json_dict({**tiny, "not_a_key": 1})
    with pytest.raises(ValueError, match="use_mla"):
        HunyuanImage3Config.from_json_dict({**tiny, "use_mla": True})
    with pytest.raises(ValueError, match="head_dim"):
        HunyuanImage3Config.from_json_dict({**tiny, "head_dim": 32})
    assert HunyuanImage3Config.from_json_dict({**tiny, "head_dim": 16}) == TINY_GOLDEN


def test_load_state_covers_checkpoint_and_names_problems(model, weights):
    foreign = [k for k in weights if k.startswith(FOREIGN_PREFIXES)]
    assert any(k.startswith("vision_model.") for k in foreign) and any(k.startswith("vision_aligner.") for k in foreign)
    assert set(model.official_names()) == set(weights) - set(foreign)
    assert model.param_name_for("model.layers.1.mlp.experts.3.down_proj.weight") == \
        ("model.layers.1.mlp.experts.down_proj.weight", 3)
    bad = dict(weights)
    bad["model.ln_f.weight"] = torch.ones(3)
    del bad["lm_head.weight"]
    bad["model.layers.0.extra.weight"] = torch.ones(1)
    fresh = HunyuanImage3Transformer(model.cfg, select("cpu"), BuildOptions(dtype=torch.float32))
    with pytest.raises(ValueError) as err:
        load_state(fresh, bad)
    msg = str(err.value)
    assert "missing lm_head.weight" in msg and "unexpected model.layers.0.extra.weight" in msg
    assert "model.ln_f.weight: checkpoint (3,) vs model (64,)" in msg


@pytest.mark.parametrize("case, start, h, w", [("A", 11, 4, 4), ("B", 28, 3, 4)])
def test_rope_tables(g, case, start, h, w):
    pos_T2 = g[f"{case}.rope_pos_yx"]
    cos_TH, sin_TH = rope_cos_sin(pos_T2, 16, 10000.0)
    check(f"{case}.rope_cos", cos_TH, g[f"{case}.rope_cos"][0])
    check(f"{case}.rope_sin", sin_TH, g[f"{case}.rope_sin"][1])
    tail = pos_T2.shape[0] - start - h * w
    mine = torch.cat([text_positions(0, start), image_positions(start, h, w), text_positions(start + h * w, tail)])
    assert torch.equal(mine, pos_T2)


# ---------------------------------------------------------------- first step (dense, full sequence)


@pytest.mark.parametrize("case", ["A", "B"])
def test_first_step(step1, g, case):
    r = step1[case]
    B, L, D = g[f"{case}.inputs_embeds"].shape
    check(f"{case}.inputs_embeds", r["x"].view(B, L, D), g[f"{case}.inputs_embeds"])
    for i, out_TD in enumerate(r["hidden"]):
        check(f"{case}.hidden_states_{i + 1}", out_TD.view(B, L, D), g[f"{case}.hidden_states_{i + 1}"])
        check(f"{case}.router_logits_layer{i}", r["router"][i], g[f"{case}.router_logits_layer{i}"])
    check(f"{case}.pred", r["pred"], g[f"{case}.pred"])
    check(f"{case}.pred_cfg", cfg_combine(r["pred"][:1], r["pred"][1:], GUIDANCE), g[f"{case}.pred_cfg"])


def test_first_step_euler_update(step1, g):
    sigmas = g["A.sched4_sigmas"]
    pred_cfg = cfg_combine(step1["A"]["pred"][:1], step1["A"]["pred"][1:], GUIDANCE)
    check("A.latents_next", euler_step(g["A.latents_xt"], pred_cfg, sigmas[0], sigmas[1]), g["A.latents_next"])


def test_cases_of_different_lengths_in_one_forward(model, g, step1):
    """A (2 x 28 tokens) and B (2 x 42) packed into one T = 140 forward give each case's own pred."""
    parts = [first_step_inputs(model, g, case) for case in ("A", "B")]
    x_TD, cos_TH, sin_TH = (torch.cat([p[i] for p in parts]) for i in range(3))
    with torch.no_grad():
        h_TD = model.backbone(x_TD, cos_TH, sin_TH,
                              DenseContext(dense_meta(torch.block_diag(parts[0][3], parts[1][3]))))
    split = parts[0][0].shape[0]
    check("packed A+B: A.pred", image_velocity(model, g, "A", h_TD[:split]), g["A.pred"])
    check("packed A+B: B.pred", image_velocity(model, g, "B", h_TD[split:]), g["B.pred"])


# ---------------------------------------------------------------- second step (cached prefix)


def test_second_step_through_cached_keys(model, g, step1):
    pos_BQ = g["A_step2.position_ids"]
    B, Q = pos_BQ.shape
    L = g["A.input_ids"].shape[1]
    t_B, latents = g["A_step2.timestep"], g["A_step2.model_input_latents"]
    h, w = latents.shape[-2:]
    cache = {layer: tuple(c.view(B, L, *c.shape[1:]) for c in kv) for layer, kv in step1["A"]["kv"].items()}
    with torch.no_grad():
        x_BQD = torch.cat([model.timestep_token(t_B)[:, None], model.image_tokens(latents, t_B)], dim=1)
        cos_TH, sin_TH = rope_cos_sin(g["A.rope_pos_yx"][pos_BQ.flatten()], model.cfg.head_dim, model.cfg.rope_theta)
        mask_TS = torch.block_diag(*g["A_step2.attention_mask"][:, 0])
        ctx = CachedStepContext(cache, pos_BQ, dense_meta(mask_TS))
        h_TD, hidden, router = run_captured(model, x_BQD.flatten(0, 1), cos_TH, sin_TH, ctx)
        pred = model.velocity(h_TD.view(B, Q, -1)[:, 1:], t_B, h, w)
    check("A_step2.inputs_embeds", x_BQD, g["A_step2.inputs_embeds"])
    for i, out_TD in enumerate(hidden):
        check(f"A_step2.hidden_states_{i + 1}", out_TD.view(B, Q, -1), g[f"A_step2.hidden_states_{i + 1}"])
        check(f"A_step2.router_logits_layer{i}", router[i], g[f"A_step2.router_logits_layer{i}"])
    check("A_step2.pred", pred, g["A_step2.pred"])


# ---------------------------------------------------------------- text


def test_text_logits_causal(model, g):
    ids_T = g["C.input_ids"][0]
    L = ids_T.shape[0]
    assert torch.equal(g["C.attention_mask"][0, 0], torch.ones(L, L, dtype=torch.bool).tril())
    cos_TH, sin_TH = rope_cos_sin(text_positions(0, L), model.cfg.head_dim, model.cfg.rope_theta)
    with torch.no_grad():
        h_TD = model.backbone(model.embed_tokens(ids_T), cos_TH, sin_TH, DenseContext(varlen_meta([L]), mask="causal"))
        logits_TV = model.text_logits(h_TD)
        two = DenseContext(varlen_meta([L, L]), mask="causal")  # two packed sequences, causal per sequence
        h2_TD = model.backbone(model.embed_tokens(ids_T.repeat(2)), cos_TH.repeat(2, 1), sin_TH.repeat(2, 1), two)
    check("C.logits", logits_TV, g["C.logits"][0])
    check("C.logits (2 packed sequences)", model.text_logits(h2_TD).view(2, L, -1), g["C.logits"][0].expand(2, -1, -1))


def test_bfloat16_model_tracks_fp32_golden(golden, weights, g):
    """Smoke test of the dtype plumbing (fp32 router and norms, fp32 heads' outputs), loose tolerance."""
    m = HunyuanImage3Transformer(TINY_GOLDEN, select("cpu"), BuildOptions(dtype=torch.bfloat16))
    load_state(m, weights)
    m.finalize()
    with torch.no_grad():
        x_TD, cos_TH, sin_TH, mask_TS = first_step_inputs(m, g, "B")
        h_TD = m.backbone(x_TD, cos_TH, sin_TH, DenseContext(dense_meta(mask_TS)))
        pred = image_velocity(m, g, "B", h_TD)
    assert h_TD.dtype == torch.bfloat16 and pred.dtype == torch.float32
    assert (pred - g["B.pred"]).abs().max().item() < 0.06 * g["B.pred"].abs().max().item()
