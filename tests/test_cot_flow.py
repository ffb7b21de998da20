"""Think / recaption before drawing: the official stage transitions, the image pass and its reuse of the CoT's K/V.

On the golden Instruct tiny weights through the real engine and scheduler.
Random tiny weights never write ``</think>`` on their own, so a script
steers what the model "chooses" at some steps (a large bias on one logit of
the real logits); forced tokens and the ratio choice are the engine's own.
The image pass's rows must be the official THINK sequences (golden), and an
image pass that reuses the CoT row's K/V must step exactly like the same
image request prefilled from scratch.
"""
from __future__ import annotations

import pytest
import torch

from golden_utils import instruct_engine, run_to_end
from omni.request import ImageRequest
from omni.scheduler import Scheduler

ATOL = 1e-5


@pytest.fixture(scope="module")
def golden(instruct_g):
    return instruct_g


@pytest.fixture(scope="module")
def engine(instruct_checkpoint):
    return instruct_engine(instruct_checkpoint, **{"kv_cache.page_tokens": 4})


class Script:
    """Biases the real logits toward one scripted token per call (None: leave the logits alone)."""

    def __init__(self, model, words):
        self.model, self.inner = model, model.text_logits
        self.ids = [None if w is None else model.tok.id_of(w) for w in words]
        model.text_logits = self

    def __call__(self, h_TD):
        return self.steer(self.inner(h_TD))

    def steer(self, out):
        token = self.ids.pop(0) if self.ids else None
        if token is not None:
            out[:, token] += 1e4
        return out

    def close(self):
        del self.model.text_logits


def think_request(meta, **kw) -> ImageRequest:
    c = meta["cases"]["THINK"]
    kw = {"bot_task": "think_recaption", **kw}
    return ImageRequest(prompt=c["prompt"], system_prompt=c["system_prompt"], height=256, width=256, steps=3,
                        guidance=5.0, seed=4, template="instruct", cot_max_tokens=40, **kw)


def run_cot(engine, req, words):
    """Admit, prefill and step the CoT pass to its end under the script; the state."""
    script = Script(engine.model, words)
    try:
        return run_to_end(engine, engine.admit(req))
    finally:
        script.close()


THINK_WORDS = ["a", "red", "cat", "make", "it", "</think>", None, "a", "red", "cat", "</recaption>"]


@pytest.mark.parametrize("drop_think, name", [(False, "THINK"), (True, "THINK_drop_think")])
def test_think_recaption_gives_the_official_image_pass(engine, golden, drop_think, name):
    meta, g = golden
    s = run_cot(engine, think_request(meta, drop_think=drop_think), THINK_WORDS)
    tok = engine.model.tok
    assert s.finish_reason == "stop" and s.tokens[6] == tok.recaption, "</think> must force <recaption>"
    written = s.prompt_len + len(s.tokens) - 1  # the CoT row's K/V: the prompt and every token fed back
    state = engine.continue_with(s)
    try:
        assert torch.equal(torch.tensor([r.seq.ids for r in state.rows]), g[f"{name}.input_ids"])
        cond, uncond = state.rows
        first_cfg = list(uncond.seq.ids).index(tok.cfg)
        assert uncond.cached == first_cfg  # copied up to where the uncond row's <cfg> tokens begin
        # the cond row keeps all the CoT wrote (drop_think: only up to where the <think> section was)
        assert cond.cached == (s.prompt_len - 1 if drop_think else written)
    finally:
        engine.release(state)
    assert engine.pool.free_pages == engine.pool.num_pages


def test_auto_size_forces_the_answer_block_and_chooses_a_ratio_greedily(engine, golden):
    meta, _ = golden
    tok = engine.model.tok
    words = THINK_WORDS + [None, None, None, "cat"]  # the script pushes a word where only a ratio may go
    s = run_cot(engine, think_request(meta, auto_size=True), words)
    tail = list(s.tokens[-4:])
    assert tail[:3] == [tok.answer, tok.boi, tok.img_size(256)]
    ratios = [tok.img_ratio(k) for k in range(len(engine.model.table))]
    assert tail[3] in ratios and s.finish_reason == "stop"
    req = engine.model.image_pass(s.request, s.tokens)
    assert (req.height, req.width) == engine.model.table[ratios.index(tail[3])]
    assert req.cot_text.replace(" ", "") == "<think>aredcatmakeit</think><recaption>aredcat</recaption>"
    engine.release(s)


@torch.inference_mode()
def test_image_pass_on_reused_kv_steps_like_a_fresh_request(engine, golden):
    """Through the scheduler: the CoT's K/V reused (and copied into the uncond row) = prefilled from scratch."""
    meta, _ = golden
    seen = {}
    engine.on_velocity = lambda st, v: seen.setdefault(st.request.request_id, []).append(v.clone())
    engine.decode = lambda st: torch.zeros(4, 4, 3, dtype=torch.uint8)  # the tiny golden VAE has no decoder
    script = Script(engine.model, THINK_WORDS)
    try:
        sched = Scheduler(engine, max_running=2)
        (cot,) = sched.submit_many([think_request(meta, request_id="cot")])
        while sched.has_work():
            sched.step()
        revised = cot.result(timeout=0).revised_prompt
        fresh = think_request(meta, request_id="fresh", bot_task="image", cot_text=revised)
        (t,) = sched.submit_many([fresh])
        while sched.has_work():
            sched.step()
        t.result(timeout=0)
    finally:
        script.close()
        del engine.decode
        engine.on_velocity = None
    assert len(seen["cot"]) == len(seen["fresh"]) == 3
    for a, b in zip(seen["cot"], seen["fresh"]):
        assert (a - b).abs().max().item() <= ATOL
    assert engine.pool.free_pages == engine.pool.num_pages


def test_unknown_bot_task_is_refused(engine, golden):
    meta, _ = golden
    with pytest.raises(ValueError, match="bot_task 'dream'"):
        engine.pages_needed(think_request(meta, bot_task="dream"))


@pytest.mark.parametrize("index", range(6))
def test_cot_plan_is_the_official_rule(engine, golden, index):
    """cases.THINK.rules: per bot_task and size, the first pass's prompt tail, stop ids, forced transitions,
    ratio slice and token budget, captured from the official generate_image."""
    meta, _ = golden
    case = meta["cases"]["THINK"]
    rule = case["rules"][index]
    tok = engine.model.tok
    req = ImageRequest(prompt=case["prompt"], system_prompt=case["system_prompt"], height=256, width=256,
                       template="instruct", bot_task=rule["bot_task"], auto_size=rule["image_size"] == "auto")
    plan = engine.model.cot_plan(req)
    first = rule["first_pass"]
    assert list(plan.row.ids[-4:]) == [tok.id_of(w) for w in first["prefix_tail"]]
    assert plan.stop_ids == frozenset(first["eos_token_id"]) and plan.max_tokens == first["max_new_tokens"]
    assert plan.forced == {tok.id_of(f["trigger"]): tuple(f["forced_ids"]) for f in rule["simulated_forcing"]}
    ratio = rule["ratio_slice_rule"]
    if ratio is None:
        assert plan.choose_after is None
    else:
        assert plan.choose_after == tok.id_of(ratio["trigger"]) and list(plan.choose_from) == ratio["allowed_token_ids"]


@torch.inference_mode()
def test_an_edit_s_image_pass_does_not_encode_its_references_again(engine, golden):
    """After the CoT pass the references' K/V are in the pool: the image pass prefills without the encoders."""
    meta, g = golden
    req = think_request(meta, images=(g["IMG.A.source_rgb_uint8"].numpy(),))
    s = run_cot(engine, req, THINK_WORDS)
    calls = []
    inner = engine.model.encode_references
    engine.model.encode_references = lambda *a: calls.append(1) or inner(*a)
    try:
        state = engine.continue_with(s)
        assert min(r.cached for r in state.rows) > state.rows[0].seq.conds[0].vit[1]
        engine.prefill([state])
    finally:
        del engine.model.encode_references
        engine.release(state)
    assert calls == [], "the references were encoded again"
    assert engine.pool.free_pages == engine.pool.num_pages
