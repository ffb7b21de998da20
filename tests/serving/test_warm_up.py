"""The server's warm-up: one default request before the engine reports ready (``serving.warmup_steps``).

On a GPU the first request of a fresh process pays JIT compiles and graph captures (BENCHMARKS.md, twelfth
session: 13.8 s of prefill and 5.5 s of first step with an empty Triton cache); the warm-up moves that cost
to startup. These run the real tiny pipeline on the CPU: the request runs to the end, leaves nothing behind
(pages, counters), and only servers ask for it.
"""
from __future__ import annotations

import logging

import pytest

from omni.engine_handle import serving_scheduler, warm_up_request
from omni.scheduler import Scheduler, default_request

from serving_harness import make_pipeline
from serving_harness import FAULT_IN_STEP, InjectedFault


@pytest.fixture
def tiny_recipe(tiny_recipe):
    """The serving tests' recipe with a default size its 1024 size table keeps (the harness lays the latents
    out as the image's bytes, which needs the request's size to be the served one)."""
    return tiny_recipe.replace_paths({"defaults.size": "1024x1024"})


def test_warm_up_runs_one_default_request_to_the_end_and_leaves_nothing(tiny_recipe):
    pipeline = make_pipeline(tiny_recipe)
    sched = Scheduler.from_recipe(pipeline, tiny_recipe)
    free = pipeline.pool.free_pages
    seconds = sched.warm_up(default_request(tiny_recipe, steps=3))
    assert seconds > 0 and pipeline.step_calls == [1, 1, 1], "prefill, three steps, decode: the whole request"
    assert sched.warm_up_s == seconds, "kept for the replica's ready message"
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
    from omni.deployment import prepare

    recipe = tiny_recipe.replace_paths({"serving.warmup_steps": steps})
    request = warm_up_request(prepare(recipe, platform="cpu")) if warm_up else None
    assert (request is None) == (not expected)
    pipeline = make_pipeline(recipe)
    with caplog.at_level(logging.INFO, logger="omni.engine"):
        serving_scheduler(pipeline, recipe, () if request is None else (request,))
    assert pipeline.step_calls == expected
    assert ("warm-up done" in caplog.text) == bool(expected)


def test_the_warm_up_request_is_built_as_the_http_layer_builds_it():
    """The flavour's system-prompt mode is resolved to its text (its prefix length then falls in the same
    captured-step bucket as the users'), and the size is the one the model generates."""
    from omni.deployment import prepare
    from omni.recipe import load_recipe

    recipe = load_recipe("cpu_tiny_instruct").replace_paths({"defaults.system_prompt": "en_unified",
                                                             "defaults.size": "300x200"})
    deployment = prepare(recipe, platform="cpu")
    req = warm_up_request(deployment)
    helpers = deployment.flavor().serving_helpers()
    assert req.system_prompt == helpers.system_prompt("en_unified") and len(req.system_prompt) > 1000
    assert (req.height, req.width) == helpers.snap(200, 300) and req.steps == recipe.serving.warmup_steps
    assert req.template == "instruct"


def test_a_failing_warm_up_raises_its_error_and_frees_its_pages(tiny_recipe):
    """The engine thread's build raises it, so the server never reports ready and says why (EngineLoop)."""
    pipeline = make_pipeline(tiny_recipe)
    sched = Scheduler.from_recipe(pipeline, tiny_recipe)
    free = pipeline.pool.free_pages
    with pytest.raises(InjectedFault, match="denoise_step"):
        sched.warm_up(default_request(tiny_recipe, prompt=f"a cat {FAULT_IN_STEP}", steps=2))
    assert pipeline.pool.free_pages == free and not sched.has_work()


@pytest.mark.parametrize("recipe_name, kinds", [("cpu_tiny", ["ImageRequest"]),
                                                ("cpu_tiny_instruct", ["ImageRequest", "ImageRequest", "TextRequest"])])
def test_an_editing_flavour_also_warms_up_an_edit_and_one_that_writes_text_an_answer(recipe_name, kinds):
    """Text decode steps compile their own kernels and capture their own graphs, and an edit's prefill runs
    the reference encoders: an Instruct server warms up an edit of one reference of the default size and a
    short greedy answer after the image, on the real engine, and is left with nothing running."""
    from omni.deployment import prepare
    from omni.engine_handle import warm_up_requests
    from omni.recipe import load_recipe

    recipe = load_recipe(recipe_name).replace_paths({"serving.warmup_steps": 2, "defaults.size": "256x256"})
    deployment = prepare(recipe, platform="cpu")
    requests = warm_up_requests(deployment)
    assert [type(r).__name__ for r in requests] == kinds
    assert warm_up_requests(prepare(recipe.replace_paths({"serving.warmup_steps": 0}), platform="cpu")) == ()
    if len(requests) == 3:
        image, edit, answer = requests
        assert not image.images and len(edit.images) == 1 and edit.images[0].shape == (image.height, image.width, 3)
        assert edit.steps == image.steps == 2 and edit.system_prompt == image.system_prompt
        assert answer.max_tokens == 2 and answer.temperature == 0.0
        pipeline = deployment.build_pipeline(progress=False)
        seen = []
        real = pipeline.denoise_step
        pipeline.denoise_step = lambda states: (seen.extend(_kind(s) for s in states), real(states))
        sched = serving_scheduler(pipeline, recipe, requests)
        assert {"image", "edit", "TextState"} <= set(seen) and sched.warm_up_s > 0 and not sched.has_work()
        assert pipeline.pool.free_pages == pipeline.pool.num_pages


def _kind(state) -> str:
    """What a denoise step ran: a text answer (its state's class), an edit (references) or an image."""
    from omni.request import ImageRequest

    if not isinstance(state.request, ImageRequest):
        return type(state).__name__
    return "edit" if state.request.images else "image"


def test_served_request_snaps_the_size_asked_and_resolves_the_system_prompt_mode():
    """``served_request`` (what the warm-up and bench/profile_first_use build their requests with): a size asked
    for is snapped as the HTTP layer snaps it, the recipe's system-prompt mode becomes its text, and the other
    changes pass through."""
    from omni.deployment import prepare
    from omni.engine_handle import served_request
    from omni.recipe import load_recipe

    recipe = load_recipe("cpu_tiny_instruct").replace_paths({"defaults.system_prompt": "en_unified"})
    deployment = prepare(recipe, platform="cpu")
    helpers = deployment.flavor().serving_helpers()
    req = served_request(deployment, prompt="a fox", height=200, width=300, steps=3, seed=7)
    assert (req.height, req.width) == helpers.snap(200, 300) != (200, 300)
    assert req.system_prompt == helpers.system_prompt("en_unified") != "en_unified"
    assert (req.prompt, req.steps, req.seed) == ("a fox", 3, 7)
