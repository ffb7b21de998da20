"""Fixtures: the tiny model behind a real uvicorn server on 127.0.0.1 (one per test module)."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from omni.platform_manager import select
from omni.recipe import load_recipe
from omni.engine_loop import EngineLoop
from omni.scheduler import Scheduler
from omni.serving.app import ServingOptions, create_app

from serving_harness import ServerThread, TestPipeline, wait_until

MODEL_ID = "hunyuan_image3_tiny"


@pytest.fixture(scope="session")
def tiny_recipe():
    """cpu_tiny sized for the tests: room for 16 CFG requests, 2 steps, CFG off unless asked; the random-weight
    tiny flavour (1024 size table, noise images: these tests check serving, not pictures)."""
    return load_recipe("cpu_tiny").replace_paths({
        "model.flavor": "hunyuan_image3_tiny_random",
        "kv_cache.budget_bytes": 160 << 20, "serving.max_batch_tokens": 1 << 17, "serving.max_running": 8,
        "serving.max_queue": 32, "defaults.steps": 2, "defaults.guidance": 1.0})


def make_pipeline(recipe) -> TestPipeline:
    from omni.models.hunyuan_image3.build import build_pipeline

    return TestPipeline(build_pipeline(recipe, select("cpu"), progress=False))


def serve(recipe, pipeline, **options):
    """(server thread, engine) for ``pipeline``; the caller enters and stops them."""
    engine = EngineLoop.around(Scheduler.from_recipe(pipeline, recipe)).start()
    assert engine.wait_ready(30)
    app = create_app(engine, ServingOptions.from_recipe(recipe, model_id=MODEL_ID, **options))
    return ServerThread(app), engine


@pytest.fixture(scope="module")
def served(tiny_recipe):
    pipeline = make_pipeline(tiny_recipe)
    srv, engine = serve(tiny_recipe, pipeline)
    with srv, httpx.Client(base_url=srv.url, timeout=300) as client:
        yield SimpleNamespace(url=srv.url, port=srv.port, engine=engine, scheduler=engine.scheduler,
                              pipeline=pipeline, pool=pipeline.pool, client=client)
    engine.stop()


@pytest.fixture
def drained(served):
    """After the test: every KV page back in the pool and nothing queued or running."""
    yield served
    sched, pool = served.scheduler, served.pool
    wait_until(lambda: not sched.has_work(), 120, "requests still queued or running")
    assert pool.free_pages == sched.initial_free_pages, f"{sched.initial_free_pages - pool.free_pages} pages leaked"
