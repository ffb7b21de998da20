"""Scheduler policy on a model-free pipeline: admission, budgets, fairness, cancellation, isolation."""
from __future__ import annotations

import time

import pytest

from omni.engine import Engine
from omni.request import ImageRequest
from omni.engine_loop import EngineLoop
from omni.scheduler import Scheduler
from omni.scheduler_errors import EngineUnavailable, QueueFull, RequestCancelled, RequestTooLarge

from serving_harness import FAULT_IN_DECODE, FAULT_IN_STEP, FakePipeline, InjectedFault, wait_until


def req(name: str, *, size: int = 64, steps: int = 2, cfg: bool = False, prompt: str = "p") -> ImageRequest:
    """size x size pixels: (size/16)^2 + 9 tokens per row, pages of 16 tokens."""
    return ImageRequest(prompt=prompt, height=size, width=size, steps=steps, guidance=5.0 if cfg else 1.0,
                        seed=0, request_id=name)


def drain(sched: Scheduler, limit: int = 1000) -> list[str]:
    """Step until idle; ids in completion order (failed and cancelled included)."""
    order = []
    for _ in range(limit):
        if not sched.has_work():
            return order
        order += [t.request_id for t in sched.step()]
    raise AssertionError("scheduler did not drain")


def test_fifo_admission_under_max_running():
    pipe = FakePipeline()
    sched = Scheduler(pipe, max_running=2)
    tickets = [sched.submit(req(f"r{i}", steps=2 + i)) for i in range(4)]
    assert drain(sched) == ["r0", "r1", "r2", "r3"]
    assert pipe.batches[:3] == [["r0", "r1"], ["r0", "r1"], ["r1", "r2"]]  # r2 joins when r0 leaves
    assert all(t.result().steps == 2 + i for i, t in enumerate(tickets))
    assert pipe.pool.free_pages == pipe.pool.num_pages


def test_requests_join_and_leave_at_step_boundaries():
    pipe = FakePipeline()
    sched = Scheduler(pipe, max_running=8)
    sched.submit(req("long", steps=4))
    sched.step()
    sched.submit(req("late", steps=1))
    drain(sched)
    assert pipe.batches == [["long"], ["long", "late"], ["long"], ["long"]]


def test_head_that_does_not_fit_is_not_overtaken():
    pipe = FakePipeline(num_pages=8)
    sched = Scheduler(pipe, max_running=8)
    sched.submit(req("small0", steps=3))  # 25 tokens: 2 pages
    big = req("big", size=112, cfg=True)  # 2 rows x 58 tokens = 8 pages: the whole pool
    sched.submit(big)
    sched.submit(req("small1", steps=1))  # would fit beside small0, but waits behind big
    sched.step()
    assert [t.request_id for t in sched.running] == ["small0"] and sched.queue_depth == 2
    drain(sched)
    assert pipe.batches[3][0] == "big" and "small1" not in sum(pipe.batches[:3], [])
    assert pipe.pool.free_pages == 8


def test_activation_budget_packs_what_fits_and_runs_an_oversized_request_alone():
    pipe = FakePipeline(num_pages=100)
    sched = Scheduler(pipe, max_running=8, max_batch_tokens=40)  # a 64px row is 17 step tokens
    for name in ("a", "b", "c"):
        sched.submit(req(name, steps=1))
    sched.submit(req("huge", size=128, steps=1))  # 65 tokens > 40: alone
    drain(sched)
    assert pipe.batches == [["a", "b"], ["c"], ["huge"]]


def test_request_larger_than_the_pool_is_rejected_at_submit():
    sched = Scheduler(FakePipeline(num_pages=4), max_running=2)
    with pytest.raises(RequestTooLarge, match="KV pages"):
        sched.submit(req("big", size=256))
    assert sched.queue_depth == 0


def test_queue_full_is_atomic_and_says_when_to_retry():
    sched = Scheduler(FakePipeline(), max_running=1, max_queue=2)
    sched.submit_many([req("a"), req("b")])
    with pytest.raises(QueueFull) as e:
        sched.submit_many([req("c"), req("d")])  # room for one more only: neither is queued
    assert e.value.retry_after_s >= 1 and sched.queue_depth == 2
    sched.submit(req("c"))
    with pytest.raises(QueueFull):
        sched.submit(req("d"))
    assert sched.stats["rejected"] == 3


def test_cancel_waiting_and_running_frees_pages():
    pipe = FakePipeline()
    sched = Scheduler(pipe, max_running=1)
    running, waiting = sched.submit(req("run", steps=50)), sched.submit(req("wait"))
    sched.step()
    assert pipe.pool.used_pages > 0
    sched.cancel(waiting)
    assert sched.queue_depth == 0 and isinstance(waiting.future.exception(), RequestCancelled)
    sched.cancel(running)
    assert running in sched.running  # dropped at the next step boundary, not mid-step
    sched.step()
    assert not sched.has_work() and pipe.pool.free_pages == pipe.pool.num_pages
    assert isinstance(running.future.exception(), RequestCancelled) and sched.stats["cancelled"] == 2


def test_failure_in_a_packed_step_fails_only_that_request():
    pipe = FakePipeline()
    sched = Scheduler(pipe, max_running=4)
    good0 = sched.submit(req("good0", steps=3))
    bad = sched.submit(req("bad", prompt=f"x {FAULT_IN_STEP}"))
    good1 = sched.submit(req("good1", steps=3))
    drain(sched)
    assert isinstance(bad.future.exception(), InjectedFault)
    # good0 was advanced before the packed step raised: the snapshot undid it, so exactly 3 steps each
    assert good0.result().image_HW3[0, 0, 0] == 3 and good1.result().image_HW3[0, 0, 0] == 3
    assert pipe.pool.free_pages == pipe.pool.num_pages and sched.stats["failed"] == 1


@pytest.mark.parametrize("prompt", ["FAULT_IN_ADMIT", FAULT_IN_DECODE])
def test_failure_in_admit_or_decode_fails_only_that_request(prompt):
    pipe = FakePipeline()
    sched = Scheduler(pipe, max_running=4)
    bad, good = sched.submit(req("bad", prompt=prompt)), sched.submit(req("good"))
    drain(sched)
    assert isinstance(bad.future.exception(), InjectedFault) and good.result().steps == 2
    assert pipe.pool.free_pages == pipe.pool.num_pages


def test_packed_prefill_option_packs_and_still_isolates():
    pipe = FakePipeline()
    sched = Scheduler(pipe, max_running=4, pack_prefill=True)
    sched.submit_many([req("a"), req("b")])
    drain(sched)
    assert pipe.prefills == [["a", "b"]]
    default = FakePipeline()
    sched = Scheduler(default, max_running=4)
    sched.submit_many([req("a"), req("b")])
    drain(sched)
    assert default.prefills == [["a"], ["b"]]


def test_engine_loop_serves_then_reports_its_death():
    pipe = FakePipeline(step_delay_s=0.01)
    sched = Scheduler(pipe, max_running=2)
    engine = EngineLoop.around(sched).start()
    try:
        assert engine.wait_ready(5)
        [t] = engine.submit_many([req("ok", steps=3)])
        assert t.result(timeout=10).steps == 3
        stuck = engine.submit_many([req("stuck", steps=10_000)])[0]
        wait_until(lambda: sched.num_running == 1, 10, "not admitted")

        def broken_step():
            raise RuntimeError("scheduler bug")

        sched.step = broken_step  # a bug outside any one request kills the loop ...
        with pytest.raises(EngineUnavailable, match="scheduler bug"):
            stuck.result(timeout=10)  # ... and every waiter hears about it
        assert engine.status == "dead" and pipe.pool.free_pages == pipe.pool.num_pages
        with pytest.raises(EngineUnavailable, match="died"):
            engine.submit_many([req("late")])
    finally:
        engine.stop()


def test_engine_loop_build_failure_is_reported():
    def build():
        raise ValueError("paged KV is not served by this attention backend")

    engine = EngineLoop(build).start()
    assert not engine.wait_ready(5) and engine.status == "dead"
    assert "paged KV" in engine.unavailable_reason()


def test_engine_run_wrapper_keeps_generate_working():
    pipe = FakePipeline()
    seen = []
    results = Engine(pipe, max_running=2).run([req("a", steps=2), req("b", steps=1)],
                                              progress=lambda res, eng: seen.append(len(res)))
    assert [r.request_id for r in results] == ["b", "a"] and seen == [1, 2]
    with pytest.raises(RequestTooLarge):
        Engine(FakePipeline(num_pages=2)).run([req("big", size=256)])


# ------------------------------------------------------------------ decode off the critical path


class SlowDecode(FakePipeline):
    """A decode that takes ``decode_s``; records when each decode and each step ran (monotonic seconds)."""

    concurrent_decode = True

    def __init__(self, decode_s: float, **kw):
        super().__init__(**kw)
        self.decode_s, self.decodes, self.steps_at, self.free_at_decode = decode_s, [], [], []

    def denoise_step(self, states) -> None:
        self.steps_at.append(time.monotonic())
        super().denoise_step(states)

    def decode(self, state):
        t0 = time.monotonic()
        self.free_at_decode.append(self.pool.free_pages)
        time.sleep(self.decode_s)
        self.decodes.append((t0, time.monotonic(), state.request.request_id))
        return super().decode(state)


def steps_inside_decodes(pipe: SlowDecode) -> int:
    return sum(any(a < t < b for a, b, _ in pipe.decodes) for t in pipe.steps_at)


@pytest.mark.parametrize("threaded", [True, False])
def test_a_finished_request_decodes_while_the_others_step(threaded):
    """With the decode thread, r1's steps run while r0 decodes and r0's pages are back before its decode ends;
    inline (decode_thread=False, or a pipeline that does not allow it) no step overlaps a decode."""
    pipe = SlowDecode(decode_s=0.3, step_delay_s=0.02)
    engine = EngineLoop.around(Scheduler(pipe, max_running=2, decode_thread=threaded)).start()
    assert engine.wait_ready(5)
    short, long = engine.submit_many([req("r0", steps=1), req("r1", steps=12)])
    assert short.result(10).steps == 1 and long.result(10).steps == 12
    engine.stop()
    overlapping = steps_inside_decodes(pipe)
    assert (overlapping >= 5) if threaded else (overlapping == 0), (overlapping, pipe.decodes, pipe.steps_at)
    held_while_r0_decodes = pipe.pool.num_pages - pipe.free_at_decode[0]
    assert held_while_r0_decodes == long.cost.pages + (0 if threaded else short.cost.pages)
    assert pipe.pool.free_pages == pipe.pool.num_pages and engine.scheduler.stats["finished"] == 2


def test_a_decode_failure_on_the_decode_thread_fails_only_its_request():
    pipe = SlowDecode(decode_s=0.05)
    engine = EngineLoop.around(Scheduler(pipe, max_running=2, decode_thread=True)).start()
    assert engine.wait_ready(5)
    bad, good = engine.submit_many([req("bad", prompt=FAULT_IN_DECODE), req("good", steps=3)])
    with pytest.raises(InjectedFault):
        bad.result(10)
    assert good.result(10).steps == 3
    engine.stop()
    assert engine.scheduler.stats["failed"] == 1 and pipe.pool.free_pages == pipe.pool.num_pages


class CancelAtLastStep(FakePipeline):
    """Cancels the ticket of every request during its last denoising step: its client left right then."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.sched, self.decoded = None, []

    def denoise_step(self, states) -> None:
        super().denoise_step(states)
        for t in [t for t in self.sched.running if t.state in states and t.state.done]:
            self.sched.cancel(t)

    def decode(self, state):
        self.decoded.append(state.request.request_id)
        return super().decode(state)


@pytest.mark.parametrize("threaded", [True, False])
def test_a_request_whose_client_left_before_its_decode_is_not_decoded(threaded):
    pipe = CancelAtLastStep()
    pipe.concurrent_decode = threaded
    sched = pipe.sched = Scheduler(pipe, max_running=2, decode_thread=threaded)
    gone = sched.submit(req("gone", steps=2))
    drain(sched)
    sched.close()
    assert isinstance(gone.future.exception(), RequestCancelled) and pipe.decoded == []
    assert sched.stats["cancelled"] == 1 and sched.stats["finished"] == 0
    assert pipe.pool.free_pages == pipe.pool.num_pages
