"""The parity scenario, run the same way on one process and on every rank of a parallel layout.

Three requests on the golden tiny weights, packed into every forward:

    A  pretrain template, CFG pair, 1024x1024 -> 4x4 tokens (golden case A's latents)
    B  instruct template, system prompt and CoT, CFG pair, 896x1152 -> 3x4 tokens
    C  B's size without guidance: one row, so the packed token counts are odd
       (prefill 11+11+28+28+28 = 106... and 17+17+13+13+13 = 73 step tokens):
       the sequence-parallel splits are uneven.

One prefill, then two denoising steps through the prefix-KV pool (the second
step reuses the prefix K/V written by the prefill). Every row's velocity
prediction and every request's latents are recorded after each step.
"""
from __future__ import annotations

import types

import torch

from golden_utils import GOLDEN_DIR
GOLDEN_TENSORS = GOLDEN_DIR / "hunyuan_image3_tiny.safetensors"
SKIP = ("golden.", "vae.", "vision_model.", "vision_aligner.")
PAGE = 4  # small pages: rows span several pages, and prefixes end mid-page


def golden_available() -> bool:
    return GOLDEN_TENSORS.is_file() and (GOLDEN_DIR / "hunyuan_image3_tiny.json").is_file()


def requests():
    from omni.request import ImageRequest

    b = dict(height=896, width=1152, template="instruct", system_prompt="You draw images.",
             cot_text="<recaption>a photo of a red cat on green grass</recaption>", steps=4)
    return [ImageRequest(prompt="a red cat on green grass", height=1024, width=1024, steps=4, guidance=5.0, seed=0,
                         request_id="A"),
            ImageRequest(prompt="a red cat on green grass", guidance=5.0, seed=1, request_id="B", **b),
            ImageRequest(prompt="a cat", guidance=1.0, seed=2, request_id="C", **b)]


def build(platform, parallel=None, paged: bool = True, fused: bool = False):
    """The recording pipeline over the golden weights (sharded for this rank when ``parallel``); ``fused``: the
    shared expert as the routed experts' last group (``kernels.fuse_shared_expert``)."""
    from omni.kv_pool import KVPool
    from omni.weights import load_checkpoint
    from omni.build_options import BuildOptions
    from omni.models.hunyuan_image3.build import build_transformer
    from omni.models.hunyuan_image3.config import TINY_GOLDEN as cfg
    from omni.models.hunyuan_image3.pipeline import HunyuanImage3T2I
    from omni.models.hunyuan_image3.tokenizer import Tokenizer
    from omni.parallel.runtime import SingleDevice
    from omni.step_engine import StepEngine

    model, target = build_transformer(cfg, platform, BuildOptions(dtype=torch.float32, paged_kv=paged,
                                                                  page_size=PAGE if paged else 0,
                                                                  fuse_shared_expert=fused),
                                      device="cpu", parallel=parallel)
    load_checkpoint(GOLDEN_DIR, [target], skip_prefixes=SKIP, progress=False, files=[GOLDEN_TENSORS])
    model.finalize()
    kv = cfg.num_key_value_heads if parallel is None else \
        parallel.pool_kv_heads(cfg.num_key_value_heads, cfg.num_attention_heads)
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_pages=128, page_size=PAGE, num_kv_heads=kv,
                  head_dim=cfg.head_dim, dtype=torch.float32, device="cpu")
    vae = types.SimpleNamespace(cfg=types.SimpleNamespace(latent_channels=cfg.latent_channels))

    trace = {}

    def record(s, v_BChw):  # every row's velocity of a request after each step, as the sampler receives it
        trace.setdefault(s.request.request_id, []).append(v_BChw.clone())

    t2i = HunyuanImage3T2I(transformer=model, vae=vae, tokenizer=Tokenizer.tiny(), config=cfg, device="cpu")
    pipe = StepEngine(t2i, pool=pool, runtime=SingleDevice() if parallel is None else parallel, device="cpu",
                      paged=paged, on_velocity=record)
    pipe.trace = trace
    return pipe


@torch.inference_mode()
def run_scenario(pipe, latents_A: torch.Tensor | None = None, steps: int = 2) -> dict:
    """Prefill + ``steps`` denoising steps; {request id: {"pred": [per step], "latents": [per step]}}."""
    states = [pipe.admit(r) for r in requests()]
    if latents_A is not None:
        states[0].latents_1Chw = latents_A.clone()
    pipe.prefill(states)
    out = {s.request.request_id: {"pred": [], "latents": []} for s in states}
    for _ in range(steps):
        pipe.denoise_step(states)
        for s in states:
            out[s.request.request_id]["latents"].append(s.latents_1Chw.clone())
    for rid, preds in pipe.trace.items():
        out[rid]["pred"] = [p.clone() for p in preds]
    free_before = pipe.pool.free_pages
    for s in states:
        pipe.release(s)
    out["_pages_released"] = pipe.pool.free_pages - free_before
    out["_pool_all_free"] = pipe.pool.free_pages == pipe.pool.num_pages
    return out


def golden_latents_A() -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(GOLDEN_TENSORS), framework="pt") as f:
        return f.get_tensor("golden.A.latents_xt")


def layout_worker(ctx, layouts: list[tuple]) -> dict:
    """Run the scenario under every layout (same world size) on this rank; results by (layout label, paged[,
    fused]): a third element builds the model with the shared expert fused."""
    from omni.parallel.mesh import Degrees, Mesh
    from omni.parallel.runtime import ParallelRuntime

    latents = golden_latents_A()
    results, meshes = {}, {ctx.degrees: ctx.mesh}
    for layout in layouts:
        label, paged, *fused = layout
        degrees = Degrees.parse(label)
        if degrees not in meshes:
            meshes[degrees] = Mesh.build(degrees, platform=ctx.platform)
        pipe = build(ctx.platform, ParallelRuntime(meshes[degrees], ctx.platform), paged=paged, fused=any(fused))
        results[layout] = run_scenario(pipe, latents)
    return results
