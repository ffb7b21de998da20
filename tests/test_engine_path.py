"""The prefix-KV engine path equals the official full-sequence masked path.

The golden tensors come from the official code running the whole sequence
with the generalized-causal mask. Here the text prefix is prefilled once
(causal) into the paged KV pool, and each step runs only ``<timestep>`` +
image tokens as two mask-free varlen runs per row. Hidden states, velocities
and Euler updates must match to 1e-5, for paged and gathered (contiguous)
keys and for page sizes that do and do not divide the rows.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from golden_utils import assert_close as close, build_golden_model  # fp32: golden_utils.fp32_bound
from omni.kv_pool import KVPool, PoolContext, Run
from omni.platform_manager import select
from omni.models.hunyuan_image3.rope import rope_cos_sin
from omni.models.hunyuan_image3.sampler import cfg_combine, euler_step


@pytest.fixture(scope="module", params=[(True, 3), (True, 16), (False, 5)], ids=["paged-3", "paged-16", "gather-5"])
def engine(request, golden_data):
    paged, page = request.param
    model = build_golden_model(golden_data, select("cpu"), paged_kv=paged, page_size=page if paged else 0)
    cfg = model.cfg
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_pages=64, page_size=page,
                  num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.float32, device="cpu")
    return model, pool, paged


def rope(model, pos_T2):
    return rope_cos_sin(pos_T2, model.cfg.head_dim, model.cfg.rope_theta)


def prefill(model, pool, paged, ids_BL, pos_L2, P):
    """Causal forward over each row's first P tokens; returns (pages per row, h of the prefix)."""
    pages = [pool.allocate(ids_BL.shape[1]) for _ in range(ids_BL.shape[0])]
    runs = [Run(tuple(p), 0, P, P) for p in pages]
    ctx = PoolContext(pool, runs, mask="causal", paged=paged, device="cpu")
    x = model.embed_tokens(ids_BL[:, :P].reshape(-1))
    h = model.backbone(x, *rope(model, pos_L2[:P].repeat(len(pages), 1)), ctx)
    return pages, h.view(len(pages), P, -1)


def step(model, pool, paged, pages, pos_L2, P, latents, t):
    """One image-block forward per row; returns (h of the block per row, velocity per row)."""
    hw = latents.shape[-1] * latents.shape[-2]
    t_1 = torch.tensor([t])
    block = torch.cat([model.timestep_token(t_1), model.image_tokens(latents, t_1)[0]])
    runs = [r for p in pages for r in (Run(tuple(p), P, P + 1, P + 1), Run(tuple(p), P + 1, P + 1 + hw, P + 1 + hw))]
    ctx = PoolContext(pool, runs, mask="none", paged=paged, device="cpu")
    x = block.repeat(len(pages), 1)
    h = model.backbone(x, *rope(model, pos_L2[P:P + 1 + hw].repeat(len(pages), 1)), ctx).view(len(pages), 1 + hw, -1)
    v = model.velocity(h[:, 1:], t_1.repeat(len(pages)), latents.shape[-2], latents.shape[-1])
    return h, v


@torch.inference_mode()
@pytest.mark.parametrize("case", ["A", "B"])
def test_prefix_kv_first_step_matches_masked_path(engine, golden_data, case):
    model, pool, paged = engine
    g = golden_data[1]
    P = int(g[f"{case}.gen_timestep_scatter_index"][0, 0])
    pos = g[f"{case}.rope_pos_yx"]
    pages, h_pre = prefill(model, pool, paged, g[f"{case}.input_ids"], pos, P)
    h_blk, v = step(model, pool, paged, pages, pos, P, g[f"{case}.latents_xt"], float(g[f"{case}.timestep"][0]))
    close("prefix hidden", h_pre, g[f"{case}.hidden_states_2"][:, :P])
    close("block hidden", h_blk, g[f"{case}.hidden_states_2"][:, P:P + h_blk.shape[1]])
    close("pred", v, g[f"{case}.pred"])
    close("pred_cfg", cfg_combine(v[:1], v[1:], 5.0), g[f"{case}.pred_cfg"])
    for p in pages:
        pool.release(p)


@torch.inference_mode()
def test_prefix_kv_cached_second_step(engine, golden_data):
    """Step 2 reuses the prefix K/V written once and overwrites the block K/V in place."""
    model, pool, paged = engine
    g = golden_data[1]
    P, pos = int(g["A.gen_timestep_scatter_index"][0, 0]), g["A.rope_pos_yx"]
    pages, _ = prefill(model, pool, paged, g["A.input_ids"], pos, P)
    step(model, pool, paged, pages, pos, P, g["A.latents_xt"], 1000.0)
    h2, v2 = step(model, pool, paged, pages, pos, P, g["A.latents_next"], float(g["A_step2.timestep"][0]))
    close("step2 hidden", h2, g["A_step2.hidden_states_2"])
    close("step2 pred", v2, g["A_step2.pred"])
    for p in pages:
        pool.release(p)
    assert pool.free_pages == pool.num_pages


# ---------------------------------------------------------------- through the pipeline and the loader


@pytest.fixture(scope="module")
def golden_checkpoint(golden_data, tmp_path_factory):
    """The golden weights written as an HF-format checkpoint directory (config, safetensors, tokenizer)."""
    from importlib import resources

    root = tmp_path_factory.mktemp("golden_ckpt")
    (root / "config.json").write_text(json.dumps(golden_data[0]["tiny_config"]))
    save_file({k: v.contiguous() for k, v in golden_data[2].items()}, str(root / "model.safetensors"))
    tok = resources.files("omni.models.hunyuan_image3.assets").joinpath("tiny_tokenizer.json")
    (root / "tokenizer.json").write_text(tok.read_text())
    return root


@pytest.fixture(scope="module")
def pipeline(golden_checkpoint):
    from omni.recipe import load_recipe
    from omni.models.hunyuan_image3.build import build_pipeline

    recipe = load_recipe("cpu_tiny").replace_path("model.path", str(golden_checkpoint))
    return build_pipeline(recipe, select("cpu"), progress=False)


def admit_golden(pipeline, g, case, **kw):
    from omni.request import ImageRequest

    req = ImageRequest(prompt="a red cat on green grass", steps=4, guidance=5.0, seed=0, **kw)
    s = pipeline.admit(req)
    assert [list(r.seq.ids) for r in s.rows] == g[f"{case}.input_ids"].tolist()
    s.latents_1Chw = g[f"{case}.latents_xt"].clone()
    return s


@torch.inference_mode()
def test_pipeline_two_steps_match_official(pipeline, golden_data):
    """Sequence building, prefill, packed steps, CFG and Euler: the whole loop against golden A."""
    g = golden_data[1]
    s = admit_golden(pipeline, g, "A", height=1024, width=1024)
    pipeline.prefill([s])
    pipeline.denoise_step([s])
    close("latents after step 1", s.latents_1Chw, g["A.latents_next"])
    pipeline.denoise_step([s])
    sig = g["A.sched4_sigmas"]
    want = euler_step(g["A.latents_next"], cfg_combine(g["A_step2.pred"][:1], g["A_step2.pred"][1:], 5.0),
                      sig[1], sig[2])
    close("latents after step 2", s.latents_1Chw, want)
    pipeline.release(s)


@torch.inference_mode()
def test_requests_packed_together_equal_each_alone(pipeline, golden_data):
    """A (pretrain, 4x4) and B (instruct, 3x4, CoT) in one forward give their solo results."""
    g, info = golden_data[1], golden_data[0]["cases"]["B"]
    a = admit_golden(pipeline, g, "A", height=1024, width=1024)
    b = admit_golden(pipeline, g, "B", height=896, width=1152, template="instruct",
                     system_prompt=info["system_prompt"], cot_text=info["cot_text"])
    b.sigmas = torch.tensor([0.75, 0.5, 0.25, 0.0])  # B's golden step is at t = 750
    pipeline.prefill([a, b])
    pipeline.denoise_step([a, b])
    close("A in a packed batch", a.latents_1Chw, g["A.latents_next"])
    close("B in a packed batch", b.latents_1Chw, euler_step(g["B.latents_xt"], g["B.pred_cfg"], 0.75, 0.5))
    for s in (a, b):
        pipeline.release(s)
    assert pipeline.pool.free_pages == pipeline.pool.num_pages
