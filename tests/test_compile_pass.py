"""The warm-up's compile pass (``serving.compile_first``, ``omni.compile_pass``) over the real tiny pipeline.

The CPU platform compiles nothing just in time, so a recording double of a platform's compile scope
(``omni_compile_scope``, registered on the platform's own pluggy manager) stands in for the cuda platform's
``triton_compile.compiling()``; what is checked is what core does around it: the warm-up requests run once
inside the scope (eagerly, decoded on the engine thread, pages returned) and then for real, a failed pass does
not stop the warm-up, and the pass leaves nothing behind that changes a later image. The cuda side (kernels
compiled, not run; the router and the sort defined) is checked by ``tests/conformance/test_cuda_sm90_compile_cpu.py``
and, on a GPU, ``tests/gpu/test_gpu_compile_pass.py``.
"""
from __future__ import annotations

import logging
import threading
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from omni import compile_pass
from omni.hookspecs import hookimpl
from omni.platform_manager import select
from omni.recipe import load_recipe
from omni.request import ImageRequest
from omni.scheduler import Scheduler, default_request
from omni.specs import CaptureSpec
from omni.step_graphs import StepGraphs


class RecordingScope:
    """A compile scope that counts its entries and exits; ``fail``: raised on exit (a compile error)."""

    def __init__(self, fail: Exception | None = None):
        self.entered = self.left = 0
        self.fail = fail

    def __enter__(self):
        self.entered += 1

    def __exit__(self, *exc):
        self.left += 1
        if self.fail is not None:
            raise self.fail
        return False


class CompilingPlatform:
    """The hook a just-in-time platform implements, answering with ``scope``."""

    def __init__(self, scope):
        self.scope = scope

    @hookimpl
    def omni_compile_scope(self, info):
        return self.scope


class Watched:
    """The real pipeline; records each model call with whether a compile pass was on and which thread ran it;
    ``fail_in_pass``: the step that raises inside the pass (undefined outputs tripping a check)."""

    def __init__(self, pipeline, fail_in_pass: str = ""):
        self.pipeline, self.fail_in_pass, self.calls = pipeline, fail_in_pass, []

    def __getattr__(self, name):
        attr = getattr(self.pipeline, name)
        if name not in ("prefill", "denoise_step", "decode"):
            return attr

        def call(*args):
            self.calls.append((name, compile_pass.active(), threading.current_thread() is threading.main_thread()))
            if compile_pass.active() and name == self.fail_in_pass:
                raise ValueError(f"{name} read an output no kernel wrote")
            return attr(*args)

        return call


RECIPE = load_recipe("cpu_tiny")


def pipeline_on(scope=None, fail_in_pass: str = ""):
    from omni.models.hunyuan_image3.build import build_pipeline

    platform = select("cpu")
    if scope is not None:
        platform.pm.register(CompilingPlatform(scope), name="jit-double")
    return Watched(build_pipeline(RECIPE, platform, progress=False), fail_in_pass)


def warmed(pipeline, compile_first: bool = True) -> Scheduler:
    sched = Scheduler.from_recipe(pipeline, RECIPE.replace_paths({"serving.compile_first": compile_first}))
    assert sched._decoder is not None, "the CPU pipeline decodes on the scheduler's thread outside a pass"
    sched.warm_up(default_request(RECIPE, steps=2))
    return sched


def image_after(sched: Scheduler) -> np.ndarray:
    ticket = sched.submit(ImageRequest(prompt="a green door", steps=2, seed=11, request_id="after"))
    while not ticket.future.done():
        sched.step()
    return ticket.result().image_HW3


def test_the_warm_up_runs_inside_the_scope_first_then_for_real():
    scope = RecordingScope()
    pipeline = pipeline_on(scope)
    free = pipeline.pool.free_pages
    sched = warmed(pipeline)
    assert (scope.entered, scope.left) == (1, 1)
    ops = [(name, on) for name, on, _ in pipeline.calls]
    once = [("prefill", True), ("denoise_step", True), ("denoise_step", True), ("decode", True)]
    assert ops == once + [(name, False) for name, _ in once], "the request in the pass, then for real"
    decoded_here = [here for name, on, here in pipeline.calls if name == "decode"]
    assert decoded_here == [True, False], "the pass decodes on its own thread (its scope is that thread's)"
    assert pipeline.pool.free_pages == free and not sched.has_work() and sum(sched.stats.values()) == 0
    assert 0 < sched.compile_pass_s < sched.warm_up_s


def test_without_a_platform_scope_no_pass_runs(caplog):
    pipeline = pipeline_on()
    with caplog.at_level(logging.INFO, logger="omni.compile_pass"):
        sched = warmed(pipeline)
    assert [(name, on) for name, on, _ in pipeline.calls] == [
        ("prefill", False), ("denoise_step", False), ("denoise_step", False), ("decode", False)]
    assert sched.compile_pass_s is None and "no compile pass" in caplog.text


def test_compile_first_off_never_asks_the_platform():
    scope = RecordingScope()
    pipeline = pipeline_on(scope)
    warmed(pipeline, compile_first=False)
    assert scope.entered == 0 and not any(on for _, on, _ in pipeline.calls)
    assert Scheduler.from_recipe(pipeline, RECIPE).compile_first is False, "off unless the recipe asks"


@pytest.mark.parametrize("failure", ["compile error on exit", "a request of the pass fails"])
def test_a_failed_pass_is_logged_and_the_warm_up_still_runs(failure, caplog):
    exit_error = RuntimeError("ptxas: out of resources") if failure.startswith("compile") else None
    scope = RecordingScope(fail=exit_error)
    pipeline = pipeline_on(scope, fail_in_pass="" if exit_error else "denoise_step")
    free = pipeline.pool.free_pages
    with caplog.at_level(logging.WARNING, logger="omni.compile_pass"):
        sched = warmed(pipeline)
    expected = "ptxas: out of resources" if exit_error else "read an output no kernel wrote"
    assert "compile pass failed" in caplog.text and expected in caplog.text
    assert scope.left == 1, "the scope is left (its compiles awaited) whatever failed inside"
    assert [name for name, on, _ in pipeline.calls if not on] == ["prefill", "denoise_step", "denoise_step",
                                                                  "decode"], "the real warm-up ran whole"
    assert pipeline.pool.free_pages == free and not sched.has_work()


def test_the_pass_leaves_nothing_that_changes_a_later_image():
    with_pass = image_after(warmed(pipeline_on(RecordingScope())))
    without = image_after(warmed(pipeline_on(), compile_first=False))
    assert with_pass.shape == without.shape and np.array_equal(with_pass, without)


class RecordingRunner:
    """A graph runner double: counts captures and replays (``fn`` runs once at capture, as a warm-up would)."""

    def __init__(self, counts: dict):
        self.counts = counts

    def capture(self, fn):
        self.counts["captures"] += 1
        self.out = fn()
        return self.out

    def replay(self):
        self.counts["replays"] += 1


class CapturingPlatform:
    def __init__(self):
        self.counts = {"captures": 0, "replays": 0}

    def graph_runner(self, spec: CaptureSpec):
        return RecordingRunner(self.counts)


def test_step_graphs_run_eagerly_during_a_pass_and_capture_after_it():
    platform = CapturingPlatform()
    graphs = StepGraphs(platform, "cpu")
    x, calls = torch.ones(4, 2), []

    def forward(x_TD, w):
        calls.append(compile_pass.active())
        return x_TD * w

    key = (("sig",), ("binding",))
    with compile_pass.compile_pass(nullcontext()):
        out = graphs.run(key, x, forward, lambda: (torch.full((2,), 3.0),))
    assert torch.equal(out, x * 3) and calls == [True]
    assert platform.counts == {"captures": 0, "replays": 0} and graphs.captures == 0, "nothing recorded in the pass"
    graphs.run(key, x, forward, lambda: (torch.full((2,), 3.0),))
    assert platform.counts == {"captures": 1, "replays": 1} and calls == [True, False]


def test_the_servers_warm_up_log_says_what_the_pass_took(caplog):
    from omni.engine_handle import serving_scheduler

    recipe = RECIPE.replace_paths({"serving.compile_first": True})
    with caplog.at_level(logging.INFO, logger="omni.engine"):
        sched = serving_scheduler(pipeline_on(RecordingScope()), recipe, (default_request(recipe, steps=2),))
    assert f"(compile pass {sched.compile_pass_s:.1f} s of it)" in caplog.text


# ---------------------------------------------------------------- a one-image job's pass (omni-run generate)


def test_compile_ahead_requests_run_in_the_pass_only():
    from omni.engine_handle import serving_scheduler

    scope = RecordingScope()
    pipeline = pipeline_on(scope)
    free = pipeline.pool.free_pages
    recipe = RECIPE.replace_paths({"serving.compile_first": True})
    sched = serving_scheduler(pipeline, recipe, compile_ahead=(default_request(recipe, steps=2),))
    assert (scope.entered, scope.left) == (1, 1)
    assert [(name, on) for name, on, _ in pipeline.calls] == [
        ("prefill", True), ("denoise_step", True), ("denoise_step", True), ("decode", True)], "in the pass alone"
    assert sched.warm_up_s >= sched.compile_pass_s > 0 and pipeline.pool.free_pages == free


def test_a_job_on_a_platform_without_a_pass_reports_no_warm_up(caplog):
    from omni.engine_handle import serving_scheduler

    pipeline = pipeline_on()
    recipe = RECIPE.replace_paths({"serving.compile_first": True})
    with caplog.at_level(logging.INFO, logger="omni"):
        sched = serving_scheduler(pipeline, recipe, compile_ahead=(default_request(recipe, steps=2),))
    assert pipeline.calls == [] and sched.compile_pass_s is None and "no compile pass" in caplog.text
    assert "warm-up done" not in caplog.text, "nothing ran, so no warm-up time is reported"


def test_compile_ahead_is_ignored_without_compile_first():
    from omni.engine_handle import serving_scheduler

    scope = RecordingScope()
    pipeline = pipeline_on(scope)
    sched = serving_scheduler(pipeline, RECIPE, compile_ahead=(default_request(RECIPE, steps=2),))
    assert scope.entered == 0 and pipeline.calls == [] and sched.warm_up_s is None


def test_a_jobs_pass_runs_its_own_request_cut_to_the_warm_up_steps():
    from omni.deployment import prepare
    from omni.engine_handle import colour_ramp, compile_ahead_request

    d = prepare("cpu_tiny", overrides={"serving.compile_first": True, "serving.warmup_steps": 3})
    job = ImageRequest(prompt="a red fox", height=256, width=384, steps=20, seed=5, bot_task="think",
                       cot_max_tokens=500, images=(colour_ramp(64, 64),), request_id="job")
    ahead = compile_ahead_request(d, job)
    assert (ahead.steps, ahead.cot_max_tokens, ahead.request_id) == (3, 3, "job-compile-ahead")
    kept = ("prompt", "height", "width", "seed", "bot_task", "guidance", "system_prompt")
    assert all(getattr(ahead, k) == getattr(job, k) for k in kept) and ahead.images is job.images
    short = compile_ahead_request(d, ImageRequest(prompt="x", steps=1, cot_max_tokens=1))
    assert (short.steps, short.cot_max_tokens) == (1, 1), "never more than the job asked for"


def deployment_on(monkeypatch, recipe: str, scope):
    """``recipe`` with ``compile_first``, deployed on a CPU platform whose compile scope is ``scope`` (None: the
    CPU platform's own, which has none)."""
    from omni import deployment as deployment_module

    d = deployment_module.prepare(recipe, overrides={"serving.compile_first": True})
    platform = select("cpu")  # after prepare, which selects this process's platform anew
    if scope is not None:
        platform.pm.register(CompilingPlatform(scope), name="jit-double")
    monkeypatch.setitem(deployment_module._PLATFORMS, ("cpu", False), platform)
    return d


def generate_image(tmp_path, monkeypatch, scope, name: str) -> np.ndarray:
    """``omni-run generate``'s in-process path on cpu_tiny (``deployment_on``)."""
    from PIL import Image

    from omni.generate import generate_main
    from omni.request import GenerateJob

    out = tmp_path / f"{name}.png"
    job = GenerateJob(ImageRequest(prompt="a green door", height=256, width=256, steps=3, seed=7), out)
    assert generate_main(deployment_on(monkeypatch, "cpu_tiny", scope), job) == 0
    return np.asarray(Image.open(out))


def test_generate_compiles_its_request_first_and_draws_the_same_image(tmp_path, monkeypatch, caplog):
    scope = RecordingScope()
    with caplog.at_level(logging.INFO, logger="omni.compile_pass"):
        with_pass = generate_image(tmp_path, monkeypatch, scope, "with")
    assert (scope.entered, scope.left) == (1, 1) and "compile pass:" in caplog.text
    without = generate_image(tmp_path, monkeypatch, None, "without")
    assert with_pass.shape == without.shape and with_pass.ndim == 3 and np.array_equal(with_pass, without)


def chat_answers(monkeypatch, scope, prompts: str) -> str:
    """``omni-run chat`` over stdin ``prompts`` on cpu_tiny_instruct (``deployment_on``), greedy."""
    import io

    from omni.chat import ChatJob, chat_main

    out = io.StringIO()
    job = ChatJob(prompt=None, sampling={"max_tokens": 6, "temperature": 0.0, "seed": 3})
    assert chat_main(deployment_on(monkeypatch, "cpu_tiny_instruct", scope), job, io.StringIO(prompts), out) == 0
    return out.getvalue()


def test_chat_compiles_a_first_answer_first_and_answers_the_same(monkeypatch):
    scope = RecordingScope()
    with_pass = chat_answers(monkeypatch, scope, "what is red?\nand blue?\n")
    assert (scope.entered, scope.left) == (1, 1)
    without = chat_answers(monkeypatch, None, "what is red?\nand blue?\n")
    assert with_pass == without and with_pass.count("\n") == 2


def test_a_chats_pass_answers_a_few_tokens_of_its_first_prompt():
    from omni.deployment import prepare
    from omni.engine_handle import compile_ahead_request
    from omni.request import TextRequest

    d = prepare("cpu_tiny_instruct", overrides={"serving.compile_first": True, "serving.warmup_steps": 3})
    ahead = compile_ahead_request(d, TextRequest(prompt="what is red?", max_tokens=200, seed=1, request_id="q"))
    assert (ahead.prompt, ahead.max_tokens, ahead.seed, ahead.request_id) == ("what is red?", 3, 1,
                                                                                "q-compile-ahead")
