"""The server's warm-up: one default request before the engine reports ready (``serving.warmup_steps``).

On a GPU the first request of a fresh process pays JIT compiles and graph captures (BENCHMARKS.md, twelfth
session: 13.8 s of prefill and 5.5 s of first step with an empty Triton cache); the warm-up moves that cost
to startup. These run the real tiny pipeline on the CPU: the request runs to the end, leaves nothing behind
(pages, counters), and only servers ask for it.
"""
from __future__ import annotations

import logging

import pytest

from omni.engine_handle import serving_scheduler
from omni.scheduler import Scheduler, default_request

from conftest import make_pipeline


@pytest.fixture
def tiny_recipe(tiny_recipe):
    """The serving tests' recipe with a default size its 1024 size table keeps (the harness lays the latents
    out as the image's bytes, which needs the request's size to be the served one)."""
    return tiny_recipe.replace_paths({"defaults.size": "1024x1024"})
from serving_harness import TestPipeline  # noqa: F401 - make_pipeline's wrapper counts the denoise steps


def test_warm_up_runs_one_default_request_to_the_end_and_leaves_nothing(tiny_recipe):
    pipeline = make_pipeline(tiny_recipe)
    sched = Scheduler.from_recipe(pipeline, tiny_recipe)
    free = pipeline.pool.free_pages
    seconds = sched.warm_up(default_request(tiny_recipe, steps=3))
    assert seconds > 0 and pipeline.step_calls == [1, 1, 1], "prefill, three steps, decode: the whole request"
    assert pipeline.pool.free_pages == free and not sched.has_work()
    assert sum(sched.stats.values()) == 0, "served counters start after the warm-up"
    req = default_request(tiny_recipe, prompt="a cat", steps=2, seed=1)
    ticket = sched.submit(req)
    while not ticket.future.done():
        sched.step()
    assert ticket.result().image_HW3.shape == (req.height, req.width, 3) and sched.stats["finished"] == 1


def test_default_request_is_what_the_recipe_serves(tiny_recipe):
    r = default_request(tiny_recipe, steps=2)
    d = tiny_recipe.defaults
    assert (r.width, r.height) == d.width_height and r.steps == 2 and r.guidance == d.guidance
    assert r.template == d.template and r.system_prompt == d.system_prompt and r.shift == d.shift


@pytest.mark.parametrize("warm_up,steps,expected", [(False, 2, []), (True, 0, []), (True, 2, [1, 1])])
def test_only_servers_warm_up_and_zero_steps_turns_it_off(tiny_recipe, warm_up, steps, expected, caplog):
    recipe = tiny_recipe.replace_paths({"serving.warmup_steps": steps})
    pipeline = make_pipeline(recipe)
    with caplog.at_level(logging.INFO, logger="omni.engine"):
        serving_scheduler(pipeline, recipe, warm_up=warm_up)
    assert pipeline.step_calls == expected
    assert ("warm-up done" in caplog.text) == bool(expected)


def test_a_failing_warm_up_stops_the_engine_with_the_reason(tiny_recipe):
    """A default request the deployment cannot serve fails startup, naming why, instead of every request."""
    from omni.engine_loop import EngineLoop

    recipe = tiny_recipe.replace_paths({"defaults.size": "4096x4096", "kv_cache.budget_bytes": 1 << 20})
    engine = EngineLoop(lambda: serving_scheduler(make_pipeline(recipe), recipe, warm_up=True)).start()
    assert not engine.wait_ready(60)
    assert engine.status == "dead" and "KV pages" in engine.unavailable_reason()
    engine.stop()
