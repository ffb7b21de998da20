"""The server the fuzz test points schemathesis at: the embedded default, made cheap to say yes to.

``python tests/serving/fuzz_server.py PORT [RECIPE]`` serves the tiny base model (cpu_tiny; or
``cpu_tiny_instruct``: editing, text answers and CoT tasks too) with the real transformer, KV
pool, scheduler and HTTP layer; what is cut down is only the cost of an
accepted request, so that tens of thousands of cases finish on a small CPU box: one denoising
step, no CFG, sides up to 256 px, at most 3 images per call, and the harness' lossless
latents-as-image decode instead of the tiny VAE (10-30 s per image on 2 cores). The OpenAPI
document states those caps, so the fuzzer generates within them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

from serving_harness import MODEL_ID, make_pipeline  # noqa: E402

FUZZ_OVERRIDES = {"defaults.steps": 1, "defaults.size": "256x256", "defaults.guidance": 1.0,
                  "serving.max_running": 2, "serving.max_queue": 1, "serving.max_batch_tokens": 1 << 17}
# sides up to 256 px: with the 64 px minimum no size can pass the 4:1 aspect limit, the one rule JSON Schema
# cannot state, so the document is exact for this deployment
FUZZ_OPTIONS = {"max_side": 256, "max_steps": 1}


def fuzz_app(recipe_name: str = "cpu_tiny"):
    from omni.engine_loop import EngineLoop
    from omni.recipe import load_recipe
    from omni.scheduler import Scheduler
    from omni.serving.app import ServingOptions, create_app

    recipe = load_recipe(recipe_name).replace_paths(FUZZ_OVERRIDES)
    engine = EngineLoop.around(Scheduler.from_recipe(make_pipeline(recipe), recipe)).start()
    assert engine.wait_ready(60)
    return create_app(engine, ServingOptions.from_recipe(recipe, model_id=MODEL_ID, **FUZZ_OPTIONS)), engine


if __name__ == "__main__":
    app, engine = fuzz_app(*sys.argv[2:3])
    try:
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
    finally:
        engine.stop()
