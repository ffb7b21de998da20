"""Instruct editing (IT2I) end to end against the official code: full-sequence path and prefix-KV engine path.

The golden set ../shared/golden/hunyuan_image3_instruct_tiny.* holds, for one
(IT2I_1) and two (IT2I_2) reference images, every tensor of the official
first denoising step: the initial noise drawn after the posterior samples,
the layer-0 input with every scatter, each layer's hidden states and router
logits, both rows' predictions, the guided prediction and the first Euler
step. Here the golden weights are written as a checkpoint directory and the
Instruct pipeline is built from it exactly as a deployment builds it.

* full-sequence path: the pipeline's own prefix input and step block, the
  rest of the row as token embeddings, one dense-masked forward per batch
  (the official mask, which ``EditSequence.attention_mask`` reproduces);
* engine path: ``admit`` / ``prefill`` (the reference images' joint blocks
  as fully visible segments into the paged KV pool) / ``denoise_step``.

fp32 on the CPU; every tensor within 1e-5.

Shape suffixes: B rows, L row length, T packed tokens, D width, C latent
channels, h/w latent grid.
"""
from __future__ import annotations

import pytest
import torch

from golden_utils import assert_close as close, instruct_engine
from omni.attention_context import DenseContext, dense_meta
from omni.request import ImageRequest

ATOL = 1e-5
CASES = ["IT2I_1", "IT2I_2"]


@pytest.fixture(scope="module")
def golden(instruct_g):
    return instruct_g


@pytest.fixture(scope="module")
def engine(instruct_checkpoint):
    return instruct_engine(instruct_checkpoint)


def request_of(meta, g, case: str) -> ImageRequest:
    c = meta["cases"][case]
    h, w = (int(v) for v in c["image_size_argument"].split("x"))
    images = tuple(g[f"IMG.{n}.source_rgb_uint8"].numpy() for n in c["cond_images"])
    return ImageRequest(prompt=c["prompt"], system_prompt=c["system_prompt"] or None, cot_text=c["cot_text"],
                        height=h, width=w, steps=c["infer_steps"], guidance=c["guidance_scale"], seed=c["seed"],
                        template="instruct", images=images)


# ---------------------------------------------------------------- full-sequence path


def full_input(model, req: ImageRequest, rows, latents_1Chw: torch.Tensor) -> torch.Tensor:
    """``x_BLD``: the pipeline's prefix input, its step block at sigma 1, then the row's remaining tokens."""
    prefixes = model.prefix_input(req, req.seed, rows)
    block_TD = model.block_input(latents_1Chw, 1.0, rows).view(len(rows), -1, prefixes[0].shape[-1])
    out = []
    for row, prefix_LD, block_nD in zip(rows, prefixes, block_TD):
        rest = model.embed(row.ids[row.prefix_len + block_nD.shape[0]:])
        out.append(torch.cat([prefix_LD, block_nD, rest]))
    return torch.stack(out)


def run_full(model, rows, x_BLD):
    """One dense forward over both rows (block-diagonal official masks); per-layer outputs and router logits."""
    from omni.models.hunyuan_image3.rope import rope_cos_sin

    layers = model.transformer.model.layers
    hidden, router = [], []
    hooks = [m.register_forward_hook(lambda mod, a, out: hidden.append(out)) for m in layers]
    hooks += [m.mlp.gate.wg.register_forward_hook(lambda mod, a, out: router.append(out)) for m in layers]
    pos_T2 = torch.tensor([p for r in rows for p in r.pos_yx])
    cos, sin = rope_cos_sin(pos_T2, model.cfg.head_dim, model.cfg.rope_theta)
    mask_TS = torch.block_diag(*[r.attention_mask() for r in rows])
    try:
        model.transformer.backbone(x_BLD.flatten(0, 1), cos, sin, DenseContext(dense_meta(mask_TS)))
    finally:
        for h in hooks:
            h.remove()
    return hidden, router


@pytest.fixture(scope="module")
def full_path(engine, golden):
    meta, g = golden
    model, out = engine.model, {}
    with torch.inference_mode():
        for case in CASES:
            req = request_of(meta, g, case)
            rows = model.build_rows(req)
            latents = model.noise(req.seed, rows[0])
            x_BLD = full_input(model, req, rows, latents)
            hidden, router = run_full(model, rows, x_BLD)
            out[case] = dict(req=req, rows=rows, latents=latents, x=x_BLD, hidden=hidden, router=router)
    return out


@pytest.mark.parametrize("case", CASES)
def test_rows_and_mask_are_the_official_ones(full_path, golden, case):
    _, g = golden
    rows = full_path[case]["rows"]
    assert torch.equal(torch.tensor([r.ids for r in rows]), g[f"{case}.input_ids"])
    assert torch.equal(torch.stack([r.attention_mask() for r in rows]), g[f"{case}.attention_mask"][:, 0])


@pytest.mark.parametrize("case", CASES)
def test_noise_after_posterior_draws(full_path, golden, case):
    close("latents_xt", full_path[case]["latents"], golden[1][f"{case}.latents_xt"])


@pytest.mark.parametrize("case", CASES)
def test_reference_latents_and_vision_features(engine, full_path, golden, case):
    _, g = golden
    req = full_path[case]["req"]
    latents = engine.model.reference_latents(req.images, torch.Generator().manual_seed(req.seed))
    for i, z in enumerate(latents):
        want = g[f"{case}.cond_vae_latents"][:1] if len(latents) == 1 else g[f"{case}.cond{i}_vae_latent"][None]
        close(f"cond{i} latent", z, want)
    vit = engine.model.vision.encode(req.images)
    close("vit_aligner_out", vit, g[f"{case}.vit_aligner_out"])


@pytest.mark.parametrize("case", CASES)
def test_layer_inputs_hidden_states_and_router_logits(full_path, golden, case):
    _, g = golden
    r = full_path[case]
    close("inputs_embeds", r["x"], g[f"{case}.inputs_embeds"])
    B, L, D = r["x"].shape
    for i, h_TD in enumerate(r["hidden"]):
        close(f"hidden_states_{i + 1}", h_TD.view(B, L, D), g[f"{case}.hidden_states_{i + 1}"])
    for i, logits in enumerate(r["router"]):
        close(f"router_logits_layer{i}", logits, g[f"{case}.router_logits_layer{i}"])


@pytest.mark.parametrize("case", CASES)
def test_prediction_guidance_and_first_euler_step(engine, full_path, golden, case):
    _, g = golden
    r, model = full_path[case], engine.model
    rows, B, L, D = r["rows"], *r["x"].shape
    h_BLD = r["hidden"][-1].view(B, L, D)
    start, stop = rows[0].image_span
    pred = model.velocity(h_BLD[:, start - 1: stop].flatten(0, 1), rows, 1.0)
    close("pred", pred, g[f"{case}.pred"])
    from omni.models.hunyuan_image3.sampler import cfg_combine

    close("pred_guided", cfg_combine(pred[:1], pred[1:], r["req"].guidance), g[f"{case}.pred_guided"])
    sig = model.sigmas(r["req"])
    close("sched_sigmas", sig, g[f"{case}.sched_sigmas"])
    nxt = model.sample_step(r["latents"], pred, sig[0], sig[1], r["req"].guidance)
    close("latents_next", nxt, g[f"{case}.latents_next"])


# ---------------------------------------------------------------- engine path (prefix in the paged KV pool)


@pytest.fixture(scope="module", params=[("paged", 7), ("contiguous", 16)], ids=["paged-7", "contiguous"])
def kv_engine(request, instruct_checkpoint):
    mode, page = request.param  # 7 divides no segment: pages straddle text, image and block boundaries
    return instruct_engine(instruct_checkpoint, **{"kv_cache.mode": mode, "kv_cache.page_tokens": page})


@torch.inference_mode()
def test_engine_prefix_kv_step_matches_official(kv_engine, golden):
    """Both cases packed in one prefill and one step: predictions of both rows and the Euler update."""
    meta, g = golden
    seen = {}
    kv_engine.on_velocity = lambda state, v: seen.setdefault(state.request.request_id, v.clone())
    states = [kv_engine.admit(request_of(meta, g, case)) for case in CASES]
    try:
        for case, s in zip(CASES, states):
            close(f"{case} admitted noise", s.latents_1Chw, g[f"{case}.latents_xt"])
        kv_engine.prefill(states)
        kv_engine.denoise_step(states)
        for case, s in zip(CASES, states):
            close(f"{case} pred", seen[s.request.request_id], g[f"{case}.pred"])
            close(f"{case} latents after step 1", s.latents_1Chw, g[f"{case}.latents_next"])
            assert s.times.conditioning > 0
    finally:
        kv_engine.on_velocity = None
        for s in states:
            kv_engine.release(s)
    assert kv_engine.pool.free_pages == kv_engine.pool.num_pages
