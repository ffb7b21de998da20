"""Instruct text answers (T2T, I2T) against the official generate path, through the step engine.

Golden cases T2T (text prompt) and I2T (one reference image in the user
turn) of ../shared/golden/hunyuan_image3_instruct_tiny.*: the official
``gen_text`` prompt, the logits of every prompt position, then 8 greedy
tokens with the logits of every step (official HF ``generate`` with its
static KV cache). The eos the official code passed (127957) is outside the
tiny vocabulary, so it never fires: here ``stop_ids=()`` does the same.

Engine path: the prompt is prefilled into the paged KV pool (the image's
joint block as a fully visible segment), then one token per step; every
step's logits within 1e-5 (fp32, CPU), tokens exact. Full-sequence path: the
pipeline's prefix input through one dense-masked forward gives every prompt
position's logits.
"""
from __future__ import annotations

import pytest
import torch

from golden_utils import assert_close as close, instruct_engine, run_to_end
from omni.attention_context import DenseContext, dense_meta
from omni.request import TextRequest
from omni.scheduler import Scheduler

ATOL = 1e-5
CASES = ["T2T", "I2T"]


@pytest.fixture(scope="module")
def golden(instruct_g):
    return instruct_g


@pytest.fixture(scope="module")
def engine(instruct_checkpoint):
    return instruct_engine(instruct_checkpoint, **{"kv_cache.page_tokens": 5})


def request_of(meta, g, case: str, **kw) -> TextRequest:
    c = meta["cases"][case]
    images = tuple(g[f"IMG.{n}.source_rgb_uint8"].numpy() for n in c["images"])
    return TextRequest(prompt=c["prompt"], system_prompt=c["system_prompt"] or None, images=images,
                       max_tokens=len(c["generated_tokens"].split()), temperature=0.0, seed=c.get("seed", 0),
                       stop_ids=(), **kw)


class LogitsRecorder:
    """Wraps the model's ``text_logits`` and keeps every row it returns (the engine samples from these)."""

    def __init__(self, model):
        self.model, self.inner, self.rows = model, model.text_logits, []
        model.text_logits = self

    def __call__(self, h_TD):
        out = self.inner(h_TD)
        self.rows.append(out.clone())
        return out

    def close(self):
        del self.model.text_logits


@pytest.mark.parametrize("case", CASES)
def test_prompt_row_is_the_official_gen_text_prompt(engine, golden, case):
    meta, g = golden
    row = engine.model.text_row(request_of(meta, g, case))
    assert list(row.ids) == g[f"{case}.input_ids"][0].tolist()
    assert torch.equal(row.attention_mask(), g[f"{case}.prefill_attention_mask"][0, 0])


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_full_sequence_path(engine, golden, case):
    from omni.models.hunyuan_image3.rope import rope_cos_sin

    meta, g = golden
    m, req = engine.model, request_of(meta, g, case)
    row = m.text_row(req)
    with torch.inference_mode():
        x_LD = m.prefix_input(req, req.seed, [row])[0]
        cos, sin = rope_cos_sin(torch.tensor(row.pos_yx), m.cfg.head_dim, m.cfg.rope_theta)
        h_LD = m.transformer.backbone(x_LD, cos, sin, DenseContext(dense_meta(row.attention_mask())))
        close("prefill_logits", m.text_logits(h_LD)[None], g[f"{case}.prefill_logits"])


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_step_logits_through_the_engine(engine, golden, case):
    meta, g = golden
    rec = LogitsRecorder(engine.model)
    try:
        s = run_to_end(engine, engine.admit(request_of(meta, g, case)))
    finally:
        rec.close()
        engine.release(s)
    assert list(s.tokens) == g[f"{case}.generated_ids"].tolist() and s.finish_reason == "length"
    close("step_logits", torch.cat(rec.rows), g[f"{case}.step_logits"])
    assert s.text == engine.model.detokenize(list(s.tokens))
    assert engine.pool.free_pages == engine.pool.num_pages


def test_text_and_edit_requests_share_the_scheduler(engine, golden):
    """An I2T answer and a T2T answer run beside an edit: the same tokens as alone; updates stream out."""
    from omni.request import ImageRequest

    meta, g = golden
    sched = Scheduler(engine, max_running=4)
    edit = ImageRequest(prompt="make it blue", height=256, width=256, steps=3, guidance=5.0, seed=1,
                        template="instruct", images=(g["IMG.A.source_rgb_uint8"].numpy(),))
    tickets = sched.submit_many([request_of(meta, g, "I2T"), edit, request_of(meta, g, "T2T")])
    engine.decode = lambda state: torch.zeros(8, 8, 3, dtype=torch.uint8)  # the tiny golden VAE has no decoder
    try:
        while sched.has_work():
            sched.step()
    finally:
        del engine.decode
    for t, case in ((tickets[0], "I2T"), (tickets[2], "T2T")):
        r = t.result(timeout=0)
        assert r.token_ids == g[f"{case}.generated_ids"].tolist() and r.finish_reason == "length"
        streamed = []
        while not t.updates.empty():
            streamed.append(t.updates.get())
        assert streamed and streamed[-1] == r.text
        assert len(streamed) == len(r.token_ids)  # one update per token (every token here adds text)
    assert tickets[1].result(timeout=0).steps == 3
    assert engine.pool.free_pages == engine.pool.num_pages


def test_a_cancelled_answer_frees_its_pages_at_the_next_step(engine, golden):
    meta, g = golden
    sched = Scheduler(engine, max_running=2)
    (t,) = sched.submit_many([TextRequest(prompt="make a red cat", max_tokens=50, temperature=0.0, stop_ids=())])
    sched.step()
    sched.step()
    assert sched.running and engine.pool.free_pages < engine.pool.num_pages
    sched.cancel(t)
    sched.step()
    assert not sched.running and engine.pool.free_pages == engine.pool.num_pages
    with pytest.raises(Exception, match="cancelled"):
        t.result(timeout=0)


def test_answers_beside_an_image_get_several_tokens_per_image_step(engine, golden):
    """serving.text_tokens_per_image_step: a token does not wait for every image step; tokens unchanged."""
    from omni.request import ImageRequest

    meta, g = golden
    sched = Scheduler(engine, max_running=4, text_tokens_per_image_step=3)
    image = ImageRequest(prompt="a red cat", height=256, width=256, steps=20, guidance=5.0, seed=1,
                         template="instruct")
    img, text = sched.submit_many([image, request_of(meta, g, "T2T")])
    while not text.future.done():
        sched.step()
    assert text.result(timeout=0).token_ids == g["T2T.generated_ids"].tolist()
    # 8 tokens: 1 from the prefill, then 3 per iteration (one beside the image step, 2 alone): 3 image steps
    assert img.state.step == 3
    sched.cancel(img)
    sched.step()
    assert engine.pool.free_pages == engine.pool.num_pages
