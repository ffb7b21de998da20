"""Instruct-Distil (CFG-distilled MeanFlow) against the official code: golden case DISTIL.

The official pipeline with ``cfg_distilled`` and ``use_meanflow`` (the golden
Instruct tiny weights plus ``guidance_emb`` / ``timestep_r_emb``): one row,
``<timestep> <guidance> <timestep_r>`` before the image run, guidance
``bf16(1000 * 5.0) = 4992``, ``timestep_r`` the next timestep, the 8-step
shift-3 schedule; step 1 over the whole sequence, step 2 through its KV cache.
Here: the deployment's pipeline from a checkpoint directory, through the
engine's prefix-KV path (both steps), and the first step's layer input and
hidden states through the full-sequence path. fp32 on the CPU, 1e-5 per unit of magnitude
(2.5e-5 where the timestep tokens enter: see TIMESTEP_ATOL).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from golden_utils import assert_close as close, distil_request, instruct_engine, write_instruct_checkpoint
from omni.attention_context import DenseContext, dense_meta

# The step's two timestep tokens (t and the meanflow r) start from sin/cos of t * freq, an fp32 argument known only
# to eps * t (see test_golden_sampler); on an AVX-512 machine the embeddings differ by 1.7e-5 and the first layer's
# hidden rows by 7.1e-5 at |4.6| (1.5e-5 per unit); other machines stayed within 1e-5.
TIMESTEP_ATOL = 2.5e-5


@pytest.fixture(scope="module")
def golden(instruct_g):
    return instruct_g


@pytest.fixture(scope="module")
def engine(instruct_golden, tmp_path_factory):
    meta, t = instruct_golden
    distil = {**meta, "tiny_config": {**meta["tiny_config"], "cfg_distilled": True, "use_meanflow": True}}
    root = tmp_path_factory.mktemp("distil_ckpt")
    write_instruct_checkpoint(distil, t, root, keep_distil=True)
    assert json.loads((root / "config.json").read_text())["cfg_distilled"]
    return instruct_engine(root, **{"kv_cache.page_tokens": 6})


def test_distil_row_and_schedule(engine, golden):
    meta, g = golden
    req = distil_request(meta)
    (row,) = engine.model.build_rows(req)
    assert list(row.ids) == g["DISTIL.input_ids"][0].tolist()
    assert torch.equal(row.attention_mask(), g["DISTIL.attention_mask"][0, 0])
    close("sched_sigmas", engine.model.sigmas(req), g["DISTIL.sched_sigmas"])
    assert engine.model.block_len(row) == 3 + row.token_h * row.token_w


@torch.inference_mode()
def test_first_step_full_sequence_layer_input_and_hidden_states(engine, golden):
    from omni.models.hunyuan_image3.rope import rope_cos_sin

    meta, g = golden
    m, req = engine.model, distil_request(meta)
    (row,) = m.build_rows(req)
    sig = m.sigmas(req)
    prefix = m.prefix_input(req, req.seed, [row])[0]
    block = m.block_input(g["DISTIL.latents_xt"], float(sig[0]), [row], sigma_next=float(sig[1]),
                          guidance=req.guidance)
    rest = m.embed(row.ids[row.prefix_len + block.shape[0]:])
    x_LD = torch.cat([prefix, block, rest])
    close("inputs_embeds", x_LD[None], g["DISTIL.inputs_embeds"], TIMESTEP_ATOL)
    hidden = []
    hooks = [layer.register_forward_hook(lambda mod, a, out: hidden.append(out))
             for layer in m.transformer.model.layers]
    try:
        cos, sin = rope_cos_sin(torch.tensor(row.pos_yx), m.cfg.head_dim, m.cfg.rope_theta)
        m.transformer.backbone(x_LD, cos, sin, DenseContext(dense_meta(row.attention_mask())))
    finally:
        for h in hooks:
            h.remove()
    for i, h_LD in enumerate(hidden):
        close(f"hidden_states_{i + 1}", h_LD[None], g[f"DISTIL.hidden_states_{i + 1}"], TIMESTEP_ATOL)


@torch.inference_mode()
def test_two_steps_through_the_prefix_kv_path(engine, golden):
    meta, g = golden
    seen = []
    engine.on_velocity = lambda state, v: seen.append(v.clone())
    try:
        s = engine.admit(distil_request(meta))
        close("latents_xt (the seed's noise)", s.latents_1Chw, g["DISTIL.latents_xt"])
        engine.prefill([s])
        engine.denoise_step([s])
        close("step 1 pred", seen[0], g["DISTIL.pred"])
        close("step 1 latents", s.latents_1Chw, g["DISTIL.latents_next"])
        engine.denoise_step([s])
        close("step 2 pred", seen[1], g["DISTIL_step2.pred"])
        close("step 2 latents", s.latents_1Chw, g["DISTIL_step2.latents_next"])
    finally:
        engine.on_velocity = None
        engine.release(s)
    assert engine.pool.free_pages == engine.pool.num_pages


def test_a_negative_prompt_is_refused(engine, golden):
    meta, _ = golden
    with pytest.raises(ValueError, match="negative_prompt"):
        engine.model.build_rows(dataclasses.replace(distil_request(meta), negative_prompt="blurry"))


def test_a_negative_prompt_is_a_400_naming_the_field_over_http(engine, golden):
    """The model's refusal reaches the client as a 400 naming the field (never a 500), with a real server."""
    import httpx

    from omni.engine_loop import EngineLoop
    from omni.scheduler import Scheduler
    from omni.scheduler_errors import RequestInvalid
    from omni.serving.app import ServingOptions, create_app
    from serving.serving_harness import ServerThread

    meta, _ = golden
    sched = Scheduler(engine)
    with pytest.raises(RequestInvalid, match="negative_prompt"):
        sched.cost(dataclasses.replace(distil_request(meta), negative_prompt="blurry"))
    loop = EngineLoop.around(sched).start()
    try:
        app = create_app(loop, ServingOptions(model_id="distil"))
        with ServerThread(app) as server:
            r = httpx.post(f"http://127.0.0.1:{server.port}/v1/images/generations", timeout=30,
                           json={"prompt": "a red cat", "negative_prompt": "blurry", "size": "256x256"})
    finally:
        loop.stop()
    assert r.status_code == 400 and r.json()["error"]["param"] == "negative_prompt", r.text
