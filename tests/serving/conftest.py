"""Fixtures: the tiny model behind a real uvicorn server on 127.0.0.1 (one per test module)."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from omni.recipe import load_recipe

from serving_harness import make_pipeline, serve, wait_until


@pytest.fixture(scope="session")
def tiny_recipe():
    """cpu_tiny sized for the tests: room for 16 CFG requests, 2 steps, CFG off unless asked; the random-weight
    tiny flavour (1024 size table, noise images: these tests check serving, not pictures)."""
    return load_recipe("cpu_tiny").replace_paths({
        "model.flavor": "hunyuan_image3_tiny_random",
        "kv_cache.budget_bytes": 160 << 20, "serving.max_batch_tokens": 1 << 17, "serving.max_running": 8,
        "serving.max_queue": 32, "defaults.steps": 2, "defaults.guidance": 1.0})


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
