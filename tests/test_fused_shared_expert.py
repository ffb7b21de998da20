"""The shared expert as the routed experts' last group (``kernels.fuse_shared_expert``).

- The router glue appends the always-on id ``E`` with weight 1 after the renormalised top-k
  (``GlueSpec.always_on``); with 0 nothing changes.
- Loading: the checkpoint's ``shared_mlp`` tensors land in the expert stack's last group, no name is left
  over or missing, and no ``shared_mlp`` module is built.
- The fused model matches the official code (the golden step-1 hidden states and velocity, fp32 bound) and
  the unfused model layer by layer.
- Recipes refuse it with expert parallelism and with ``quant.experts_only``, naming the field.
"""
from __future__ import annotations

import pytest
import torch

from golden_utils import fp32_bound
from omni.attention_context import DenseContext, dense_meta
from omni.build_options import BuildOptions
from omni.platform_manager import select
from omni.recipe import RecipeError, load_recipe
from omni.reference_glue import ReferenceGlue
from omni.specs import GlueSpec

from test_golden_transformer import ATOL, first_step_inputs, image_velocity, run_captured


@pytest.fixture(scope="module")
def tiny(golden_data):
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
    from omni.models.hunyuan_image3.checkpoint_names import load_state

    cfg = HunyuanImage3Config.from_json_dict(golden_data[0]["tiny_config"])
    models = {}
    for fused in (False, True):
        m = HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=torch.float32, fuse_shared_expert=fused))
        load_state(m, golden_data[2])
        m.finalize()
        models[fused] = m.eval()
    return cfg, models


def test_route_appends_the_always_on_expert():
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    plain = ReferenceGlue(GlueSpec(hidden=8, head_dim=4, eps=1e-6, dtype=torch.float32, topk=2))
    fused = ReferenceGlue(GlueSpec(hidden=8, head_dim=4, eps=1e-6, dtype=torch.float32, topk=2, always_on=1))
    (w, ids), (wf, idsf) = plain.route(logits), fused.route(logits)
    assert ids.shape == (5, 2) and idsf.shape == (5, 3)
    assert torch.equal(idsf[:, :2], ids) and torch.equal(wf[:, :2], w)
    assert idsf[:, 2].tolist() == [6] * 5 and wf[:, 2].tolist() == [1.0] * 5
    with pytest.raises(ValueError, match="always_on"):
        GlueSpec(hidden=8, head_dim=4, eps=1e-6, dtype=torch.float32, always_on=-1)


def test_shared_tensors_load_into_the_last_expert_group(tiny, golden_data):
    cfg, models = tiny
    m = models[True]
    names = set(m.official_names())
    assert names == set(models[False].official_names())  # the same checkpoint, name for name
    for i, layer in enumerate(m.model.layers):
        assert layer.mlp.shared_mlp is None
        assert layer.mlp.experts.num_experts == cfg.num_experts + 1
        assert layer.mlp.experts.moe_spec.topk == cfg.moe_topk[i] + 1
        for proj in ("gate_and_up_proj", "down_proj"):
            stacked = getattr(layer.mlp.experts, proj).weight
            assert torch.equal(stacked[-1], golden_data[2][f"model.layers.{i}.mlp.shared_mlp.{proj}.weight"])
            assert torch.equal(stacked[0], golden_data[2][f"model.layers.{i}.mlp.experts.0.{proj}.weight"])


def test_fused_model_matches_the_official_first_step(tiny, golden_data):
    """Golden case A, step 1: every layer's hidden states and the velocity within the golden tests' bound."""
    _, models = tiny
    g, m = golden_data[1], models[True]
    with torch.no_grad():
        x_TD, cos_TH, sin_TH, mask_TS = first_step_inputs(m, g, "A")
        h_TD, hidden, _ = run_captured(m, x_TD, cos_TH, sin_TH, DenseContext(dense_meta(mask_TS)))
        pred = image_velocity(m, g, "A", h_TD)
    B, L, D = g["A.inputs_embeds"].shape
    for i, out_TD in enumerate(hidden):
        want = g[f"A.hidden_states_{i + 1}"]
        assert (out_TD.view(B, L, D) - want).abs().max() <= fp32_bound(want, ATOL), f"layer {i}"
    assert (pred - g["A.pred"]).abs().max() <= fp32_bound(g["A.pred"], ATOL)


def test_fused_layer_equals_the_unfused_one(tiny):
    cfg, models = tiny
    n = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        outs = [models[f].model.layers[0].mlp(n, residual_TD=n) for f in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(outs[0], n)  # the layer did something


@pytest.mark.parametrize("change,message", [
    ({"parallel.ep": 2, "parallel.tp": 2, "device.count": 2}, "parallel.ep=2"),
    ({"quant.scheme": "fp8_row", "quant.experts_only": True}, "quant.experts_only"),
])
def test_recipe_refuses_fusion_where_it_cannot_hold(change, message):
    base = load_recipe("cpu_tiny")
    with pytest.raises(RecipeError, match=message) as err:
        base.replace_paths({"kernels.fuse_shared_expert": True, **change})
    assert "kernels.fuse_shared_expert" in str(err.value)
    assert base.replace_paths(change).kernels.fuse_shared_expert is False  # the default stays valid
    assert BuildOptions.from_recipe(base.replace_paths({"kernels.fuse_shared_expert": True})).fuse_shared_expert
