"""The server the fuzz test points schemathesis at: the embedded default, made cheap to say yes to.

``python tests/serving/fuzz_server.py PORT [RECIPE] [--full-edits]`` serves the tiny base model (cpu_tiny; or
``cpu_tiny_instruct``: editing, text answers and CoT tasks too) with the real transformer, KV
pool, scheduler and HTTP layer; what is cut down is only the cost of an accepted request, so that
tens of thousands of cases finish on a small CPU box, each within schemathesis' 10 s response-time
limit: one denoising step, no CFG by default, sides up to 256 px, CoTs up to 128 tokens, at most 2
images per call and 2 reference images per edit, and the harness' lossless latents-as-image decode
instead of the tiny VAE (10-30 s per image on 2 cores). The OpenAPI document states those caps, so
the fuzzer generates within them.

An edit's reference image is VAE-encoded at the model's snap of its aspect, which for the Instruct
table's absolute rows (1024x768, 1280x720, ...) is about 1 MP whatever the upload's size: the tiny
VAE encoder took 1.5 s per such reference on 2 cores. Here the references' posterior is a cell
average of their pixels instead (``cheap_reference_posterior``); the sizes, tokens, ViT features
and everything after are the model's own.

``--full-edits`` (test_fuzz.py passes it for ``OMNI_FUZZ_FULL_EDITS=1``) keeps edits whole: the real
VAE encoder for the references and the model's own max_images (3 for the Instruct flavours); the other
caps stay. Such edits take longer than schemathesis' default response-time limit (10 s, which
``--checks all`` turns on): the fuzz test then passes ``--max-response-time FULL_EDITS_MAX_RESPONSE_S``.

``--edit-counts PATH`` writes, after each accepted edit (200), the accepted edits by their number of
reference images as JSON ({"1": ..., "2": ..., "3": ...}) to PATH (``count_edits``: the harness wraps the
API's edit handler; nothing in core counts them), so that a run shows how many multi-reference edits it made.
"""
from __future__ import annotations

import argparse
import contextvars
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

from serving_harness import MODEL_ID, make_pipeline  # noqa: E402

FUZZ_OVERRIDES = {"defaults.steps": 1, "defaults.size": "256x256", "defaults.guidance": 1.0,
                  "serving.max_running": 2, "serving.max_queue": 0, "serving.max_batch_tokens": 1 << 17,
                  # a KV pool that holds any one request the document allows: the tiny recipes' 16 MiB (16k
                  # tokens) is less than an edit of ~1 MP references takes with CFG (a 400, request_too_large)
                  "kv_cache.budget_bytes": 256 << 20}
# sides up to 256 px: with the 64 px minimum no size can pass the 4:1 aspect limit, a rule JSON Schema cannot
# state, so the document is exact for this deployment. CoTs of at most 128 tokens, references at most 2 (the
# Instruct flavours take 3) and n at most 2 (max_running 2, max_queue 0): an edit's prefill grows with the square
# of its tokens, and on 2 cores an edit of three ~1 MP references with n=3 and a 4096-token CoT took up to 12 s,
# with CFG, n=2 and a 256-token CoT 8.4 s, and 5.9 s (the slowest of 48, with CFG) with these caps
FUZZ_OPTIONS = {"max_side": 256, "max_steps": 1, "max_cot_tokens": 128}
FUZZ_MAX_IMAGES = 2
# --full-edits: schemathesis' response-time limit. The slowest accepted edit measured on the 2-core box, of 22
# edits and chats with 3 references snapping to the table's largest row (36x64 px uploads: 720x1280), CFG
# (guidance 5), n=2, a 128-token CoT (think_recaption) and size auto, took 16.4 s (the VAE encoder for the
# references, per image of the n, is most of it); 30 s leaves room for a shared box
FULL_EDITS_MAX_RESPONSE_S = 30.0


def cheap_reference_posterior(model) -> None:
    """``model``'s reference-image posterior (its VAE encoder) as the mean of each ``ffactor_spatial`` square cell
    of the pixels, repeated over the latent channels, with a tiny variance: a deterministic function of the
    image at the latent shape the encoder gives. A model without references (the base) is left as it is."""
    if not hasattr(model, "_posterior"):
        return
    factor, channels = model.vae.cfg.ffactor_spatial, model.latent_channels

    def posterior(pixels_13HW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cells = torch.nn.functional.avg_pool2d(pixels_13HW.float(), factor)
        mean = cells.repeat(1, -(-channels // cells.shape[1]), 1, 1)[:, :channels].contiguous()
        return mean, torch.full_like(mean, -30.0)

    model._posterior = posterior


def count_edits(path: str) -> Counter:
    """Count the accepted edits by their number of reference images into a Counter, written to ``path`` as JSON
    after each: ``Api.edits`` wrapped, the references counted where it takes the uploaded files."""
    from omni.serving.endpoints import Api

    counts: Counter = Counter()
    refs: contextvars.ContextVar[list | None] = contextvars.ContextVar("edit_refs", default=None)
    edits, edit_images = Api.edits, Api._edit_images

    async def counted_edits(self, request, rid):
        seen = []
        token = refs.set(seen)
        try:
            response = await edits(self, request, rid)
        finally:
            refs.reset(token)
        if response.status_code == 200 and seen:
            counts[seen[-1]] += 1
            Path(path).write_text(json.dumps({str(k): counts[k] for k in sorted(counts)}))
        return response

    def counted_images(self, parts):
        out = edit_images(self, parts)
        if (seen := refs.get()) is not None:
            seen.append(len(out))
        return out

    Api.edits, Api._edit_images = counted_edits, counted_images
    return counts


def fuzz_app(recipe_name: str = "cpu_tiny", full_edits: bool = False):
    """The app and its engine; ``full_edits``: the real VAE encoder and the model's own max_images."""
    from omni import model_registry
    from omni.engine_loop import EngineLoop
    from omni.recipe import load_recipe
    from omni.scheduler import Scheduler
    from omni.serving.app import ServingOptions, create_app

    recipe = load_recipe(recipe_name).replace_paths(FUZZ_OVERRIDES)
    pipeline = make_pipeline(recipe)
    if not full_edits:
        cheap_reference_posterior(pipeline.inner.model)
    engine = EngineLoop.around(Scheduler.from_recipe(pipeline, recipe)).start()
    assert engine.wait_ready(60)
    helpers = model_registry.get(recipe.model.flavor).serving_helpers()
    if not full_edits:
        helpers = dataclasses.replace(helpers, max_images=min(helpers.max_images, FUZZ_MAX_IMAGES))
    return create_app(engine, ServingOptions.from_recipe(recipe, model_id=MODEL_ID, helpers=helpers,
                                                         **FUZZ_OPTIONS)), engine


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("port", type=int)
    cli.add_argument("recipe", nargs="?", default="cpu_tiny")
    cli.add_argument("--full-edits", action="store_true")
    cli.add_argument("--edit-counts", metavar="PATH")
    a = cli.parse_args()
    if a.edit_counts:
        count_edits(a.edit_counts)
    app, engine = fuzz_app(a.recipe, full_edits=a.full_edits)
    try:
        uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")
    finally:
        engine.stop()
