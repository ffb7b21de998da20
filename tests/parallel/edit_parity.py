"""The editing parity scenario, run the same way on one process and on every rank of a parallel layout.

Three Instruct requests on the golden Instruct tiny weights, packed into every forward:

    E2  two reference images of different sizes (golden IT2I_2: CoT, CFG pair; one image
        alone is golden-checked in test_golden_edit_model.py, and every reference costs a VAE
        encode per layout per rank)
    T   Instruct text-to-image without guidance: one row, so the packed token
        counts are odd and the sequence-parallel splits are uneven
    A1  a text answer to golden T2T's prompt (greedy, 3 tokens); an answer about an image
        prefills like E2's prefix and then decodes the same way (golden-checked alone in
        test_golden_text.py)

The text answers decode one token per step in their own packed forward,
beside the denoising forward; their tokens and every step's logits are kept.
The pipeline is the deployment's own (``build_pipeline`` from a checkpoint
directory holding the golden weights): the reference images' joint blocks
are prefilled into the paged KV pool as fully visible segments between
causal text segments (under sequence parallel too: each segment forward is
split over the ranks), then two denoising steps run against that prefix.
Every row's velocity and every request's latents are recorded per step.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from golden_utils import GOLDEN_DIR
GOLDEN_JSON = GOLDEN_DIR / "hunyuan_image3_instruct_tiny.json"
GOLDEN_TENSORS = GOLDEN_DIR / "hunyuan_image3_instruct_tiny.safetensors"
PAGE = 4  # small pages: rows span many pages, segments end mid-page


def golden_available() -> bool:
    return GOLDEN_TENSORS.is_file() and GOLDEN_JSON.is_file()


def write_checkpoint(root: Path) -> Path:
    """The golden Instruct weights as an HF-format checkpoint directory."""
    from safetensors.torch import load_file

    from golden_utils import write_instruct_checkpoint

    return write_instruct_checkpoint(json.loads(GOLDEN_JSON.read_text()), load_file(str(GOLDEN_TENSORS)), root)


def requests():
    from safetensors import safe_open

    from omni.request import ImageRequest, TextRequest

    meta = json.loads(GOLDEN_JSON.read_text())["cases"]
    with safe_open(str(GOLDEN_TENSORS), framework="pt") as f:
        img = {n: f.get_tensor(f"golden.IMG.{n}.source_rgb_uint8").numpy() for n in "AB"}
    two = meta["IT2I_2"]
    return [ImageRequest(prompt=two["prompt"], cot_text=two["cot_text"], height=320, width=192, steps=4,
                         guidance=3.0, seed=two["seed"], template="instruct", images=(img["A"], img["B"]),
                         request_id="E2"),
            ImageRequest(prompt="a red cat", height=256, width=256, steps=4, guidance=1.0, seed=3,
                         template="instruct", request_id="T"),
            TextRequest(prompt=meta["T2T"]["prompt"], system_prompt=meta["T2T"]["system_prompt"], max_tokens=3,
                        temperature=0.0, stop_ids=(), request_id="A1")]


def build(root: Path, platform, parallel=None, paged: bool = True):
    """The deployment's Instruct pipeline over ``root`` (sharded for this rank when ``parallel``), recording."""
    from omni.models.hunyuan_image3.build import build_pipeline
    from omni.recipe import load_recipe

    recipe = load_recipe("cpu_tiny_instruct").replace_paths({
        "model.path": str(root), "kv_cache.mode": "paged" if paged else "contiguous", "kv_cache.page_tokens": PAGE})
    pipe = build_pipeline(recipe, platform, parallel=parallel, progress=False)
    pipe.trace, pipe.logits = {}, []
    pipe.on_velocity = lambda s, v_BChw: pipe.trace.setdefault(s.request.request_id, []).append(v_BChw.clone())
    inner = pipe.model.text_logits
    pipe.model.text_logits = lambda h_TD: _kept(pipe.logits, inner(h_TD))
    return pipe


def _kept(store: list, logits_TV: torch.Tensor) -> torch.Tensor:
    store.append(logits_TV.clone())
    return logits_TV


@torch.inference_mode()
def run_scenario(pipe, steps: int = 2) -> dict:
    """Prefill + ``steps`` denoising steps; {request id: {"pred": [per step], "latents": [per step]}}."""
    states = [pipe.admit(r) for r in requests()]
    images = [s for s in states if hasattr(s, "latents_1Chw")]
    out = {s.request.request_id: {"pred": [], "latents": [s.latents_1Chw.clone()]} for s in images}
    pipe.prefill(states)
    for _ in range(steps):
        pipe.denoise_step(states)
        for s in images:
            out[s.request.request_id]["latents"].append(s.latents_1Chw.clone())
    pipe.read_text(states)  # the last step's token (steps look one ahead)
    for rid, preds in pipe.trace.items():
        out[rid]["pred"] = [p.clone() for p in preds]
    out.update({s.request.request_id: {"tokens": list(s.tokens)} for s in states if s not in images})
    out["_text_logits"] = [x.clone() for x in pipe.logits]
    for s in states:
        pipe.release(s)
    out["_pool_all_free"] = pipe.pool.free_pages == pipe.pool.num_pages
    return out


def layout_worker(ctx, root: str, layouts: list[tuple[str, bool]]) -> dict:
    """Run the scenario under every layout (same world size) on this rank; results by layout label."""
    from omni.parallel.mesh import Degrees, Mesh
    from omni.parallel.runtime import ParallelRuntime

    results, meshes = {}, {ctx.degrees: ctx.mesh}
    for label, paged in layouts:
        degrees = Degrees.parse(label)
        if degrees not in meshes:
            meshes[degrees] = Mesh.build(degrees, platform=ctx.platform)
        pipe = build(Path(root), ctx.platform, ParallelRuntime(meshes[degrees], ctx.platform), paged=paged)
        results[(label, paged)] = run_scenario(pipe)
    return results
