"""Decode steps that look one ahead (``StepEngine.text_lookahead``), on the tiny golden Instruct model (CPU).

A step is launched before the host reads the tokens of the step before it;
a row's unread token is fed from the device. Checked here against the same
engine stepping one step at a time (lookahead off): the same tokens, text
and finish reasons for greedy and sampled answers of different lengths, one
of them stopping at a stop token; the order of launches and reads (a step's
tokens are read only after the next step was launched); exactly one dropped
draw per answer that stopped at a stop token; a CoT pass with forced
tokens and a ratio chosen greedily; and a packed step that fails and is
retried one request at a time by the scheduler.
"""
from __future__ import annotations

import pytest
import torch

from golden_utils import instruct_engine, run_to_end
from omni.request import TextRequest
from omni.scheduler import Scheduler
from test_cot_flow import THINK_WORDS, Script, think_request

MAX_TOKENS = (14, 22, 18)


@pytest.fixture(scope="module")
def engine(instruct_checkpoint):
    return instruct_engine(instruct_checkpoint, **{"kv_cache.page_tokens": 4})


def answers(meta, g, stop=None) -> list[TextRequest]:
    """T2T greedy, I2T sampled, T2T sampled; ``stop``: the first answer's stop ids."""
    reqs = []
    for n, (case, temperature) in zip(MAX_TOKENS, (("T2T", 0.0), ("I2T", 0.9), ("T2T", 0.8))):
        c = meta["cases"][case]
        reqs.append(TextRequest(prompt=c["prompt"], system_prompt=c["system_prompt"] or None, max_tokens=n,
                                temperature=temperature, top_k=40, seed=7 + n, stop_ids=stop if not reqs else (),
                                images=tuple(g[f"IMG.{i}.source_rgb_uint8"].numpy() for i in c["images"])))
    return reqs


class Recorder:
    """Logs the engine's decode launches (rows forwarded) and its reads of drawn tokens, in order."""

    def __init__(self, engine):
        self.engine, self.log = engine, []
        self.forward, self.to_host = engine.text_forward, engine.to_host
        engine.text_forward, engine.to_host = self._forward, self._to_host

    def _forward(self, x_TD, cos_TH, sin_TH, runs):
        self.log.append(("launch", len(runs)))
        return self.forward(x_TD, cos_TH, sin_TH, runs)

    def _to_host(self, t):
        host, _ = self.to_host(t)
        step = sum(1 for kind, _ in self.log if kind == "launch")
        return host, Ready(self.log, step)

    def close(self):
        del self.engine.text_forward  # the method again
        self.engine.to_host = self.to_host


class Ready:
    """The event a read waits on: records which launch's tokens were read."""

    def __init__(self, log, step):
        self.log, self.step = log, step

    def synchronize(self):
        self.log.append(("read", self.step))


def decode(engine, reqs, lookahead: bool):
    engine.text_lookahead = lookahead
    rec = Recorder(engine)
    states = [engine.admit(r) for r in reqs]
    try:
        engine.prefill(states)
        rec.log.clear()  # the prefill's first tokens are read at once
        while not all(s.done for s in states):
            engine.denoise_step(states)
        return [(s.tokens, s.text, s.finish_reason) for s in states], rec.log
    finally:
        rec.close()
        engine.text_lookahead = True
        for s in states:
            engine.release(s)


def first_new_token(tokens, start: int = 3) -> tuple[int, int]:
    """(index, token): the first token from ``start`` on that did not come before it."""
    i = next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])
    return i, tokens[i]


def test_lookahead_gives_the_tokens_of_one_step_at_a_time(engine, instruct_g):
    meta, g = instruct_g
    plain, _ = decode(engine, answers(meta, g), lookahead=False)
    at, stop = first_new_token(plain[0][0])
    one_at_a_time, sync_log = decode(engine, answers(meta, g, stop=(stop,)), lookahead=False)
    ahead, log = decode(engine, answers(meta, g, stop=(stop,)), lookahead=True)
    assert ahead == one_at_a_time
    assert one_at_a_time[0][2] == "stop" and len(one_at_a_time[0][0]) == at + 1  # stopped at the stop token
    assert [len(t) for t, _, _ in one_at_a_time[1:]] == list(MAX_TOKENS[1:])
    # one step at a time: each launch's tokens are read before the next launch
    launches = [n for kind, n in sync_log if kind == "launch"]
    assert sync_log == [e for k, n in enumerate(launches) for e in (("launch", n), ("read", k + 1))]
    # looking ahead: launch k's tokens are read after launch k + 1 (the last launch's: after it)
    total = sum(1 for e in log if e[0] == "launch")
    reads = [(sum(1 for e in log[:i] if e[0] == "launch"), k) for i, (kind, k) in enumerate(log) if kind == "read"]
    assert [k for _, k in reads] == list(range(1, total + 1))
    assert all(before == k + 1 or before == k == total for before, k in reads), log
    # the stopped answer ran one step more than it needed (its draw dropped); nothing else changed
    assert sum(n for kind, n in log if kind == "launch") == sum(launches) + 1


class LoggedScript(Script):
    """The script, keeping every step's logits before its bias (what the model computed from what was fed)."""

    def __init__(self, model, words):
        super().__init__(model, words)
        self.logits = []

    def __call__(self, h_TD):
        out = self.inner(h_TD)
        self.logits.append(out.clone())
        return self.steer(out)


def test_lookahead_cot_pass_with_forced_tokens_and_a_greedy_ratio_choice(engine, instruct_g):
    meta, _ = instruct_g
    words = THINK_WORDS + [None, None, None, "cat"]  # the script pushes a word where only a ratio may go
    out, logits = {}, {}
    for lookahead in (False, True):
        engine.text_lookahead = lookahead
        script = LoggedScript(engine.model, words)
        try:
            s = run_to_end(engine, engine.admit(think_request(meta, auto_size=True)))
        finally:
            script.close()
            engine.text_lookahead = True
        out[lookahead], logits[lookahead] = (s.tokens, s.finish_reason), script.logits
        engine.release(s)
    tok = engine.model.tok
    assert out[True] == out[False]
    # the same steps on the same inputs: a forced token is fed as such, and the ratio choice (which stops
    # the pass) costs no step of its own
    assert len(logits[True]) == len(logits[False])
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False]))
    tokens = out[True][0]
    assert tokens[6] == tok.recaption and list(tokens[-4:-1]) == [tok.answer, tok.boi, tok.img_size(256)]
    assert tokens[-1] in [tok.img_ratio(k) for k in range(len(engine.model.table))]
    assert engine.pool.free_pages == engine.pool.num_pages


class FailOnce:
    """Makes the first packed decode launch of more than one row raise (after the scheduler's snapshot)."""

    def __init__(self, engine):
        self.engine, self.forward, self.failed = engine, engine.text_forward, False
        engine.text_forward = self

    def __call__(self, x_TD, cos_TH, sin_TH, runs):
        if len(runs) > 1 and not self.failed and self.engine.calls > 2:
            self.failed = True
            raise RuntimeError("injected failure of a packed decode step")
        return self.forward(x_TD, cos_TH, sin_TH, runs)


def test_a_failed_packed_step_is_retried_one_request_at_a_time(engine, instruct_g):
    meta, g = instruct_g

    def serve(fail: bool):
        sched = Scheduler(engine, max_running=3)
        engine.calls = 0
        inner = engine.denoise_step
        engine.denoise_step = lambda states: (setattr(engine, "calls", engine.calls + 1), inner(states))[1]
        failing = FailOnce(engine) if fail else None
        try:
            tickets = sched.submit_many(answers(meta, g))
            while sched.has_work():
                sched.step()
            return [t.future.result(timeout=0).token_ids for t in tickets], failing
        finally:
            del engine.denoise_step, engine.calls
            if failing is not None:
                del engine.text_forward

    clean, _ = serve(fail=False)
    retried, failing = serve(fail=True)
    assert failing.failed, "the failure was injected"
    assert retried == clean
    assert engine.pool.free_pages == engine.pool.num_pages
