"""Text rows on the step engine: a prompt prefilled into the KV pool, then one token per row per step.

A ``TextRequest`` has one row: its prompt (``StepModel.text_row``; images
in the prompt are prefix segments like an edit's). ``admit`` allocates the
pages of the prompt and of ``max_tokens`` more tokens at once, so a running
answer never waits for memory; the prefill's last position gives the first
token. Each later step feeds the row's newest token at its position (one
query over every key before it and itself) and samples the next one
(``omni.sampling``). A row stops at a stop token or after ``max_tokens``.

The engine packs the new tokens of every running text row into one forward,
beside (not inside) the denoising forward of the image requests, so text
and image requests share the scheduler and join and leave between steps.
``tokens`` and ``text`` are rebound, never mutated, at every step (the
scheduler's snapshot of a state is shallow).

A *CoT pass* (an image request with a ``bot_task`` other than ``image``) is
a text row run by a ``CotPlan`` the model gives: stop tokens, tokens forced
after a trigger (fed one per step, as if sampled), and optionally one last
token chosen greedily among a set (the aspect-ratio token when the size is
"auto"). When it ends, ``then`` is the image request to run next (with the
generated CoT); the engine continues the same ticket with it.

Shape suffixes: T packed tokens, D hidden, V vocabulary.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .kv_pool import Run
from .request import StageTimes, TextRequest, TextResult
from .sampling import SamplingParams, draw


@dataclass(frozen=True)
class CotPlan:
    """How a CoT pass runs: its prompt row, when it stops and what the official code forces."""

    row: object  # RowSpec: the prompt with the assistant turn opened (``<think>`` / ``<recaption>``)
    stop_ids: frozenset[int]
    forced: dict  # token id -> ids fed right after it (a stage transition); such a token never stops
    choose_after: int | None = None  # after this token, one greedy token among ``choose_from``, then stop
    choose_from: tuple[int, ...] = ()
    max_tokens: int = 2048


@dataclass
class TextState:
    request: TextRequest
    rows: list  # one ``step_engine.Row``: the prompt's RowSpec and the pages for prompt + max_tokens
    seed: int
    stop_ids: frozenset[int]
    prompt_len: int  # kept: ``release`` empties ``rows``
    tokens: tuple[int, ...] = ()
    text: str = ""  # the detokenized answer so far (what a stream has sent)
    finish_reason: str | None = None
    times: StageTimes = field(default_factory=StageTimes)
    plan: CotPlan | None = None  # a CoT pass of an image request (None: a plain answer)
    pending: tuple[int, ...] = ()  # forced tokens still to emit
    choosing: bool = False  # the next token is the plan's greedy choice
    reserved: list = field(default_factory=list)  # pages held for the image pass's other rows

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampling(self) -> SamplingParams:
        r = self.request
        if self.plan is not None:  # an image request's CoT pass: the Instruct generation_config sampling
            return SamplingParams()
        return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)

    @property
    def max_tokens(self) -> int:
        return self.plan.max_tokens if self.plan is not None else self.request.max_tokens

    def result(self) -> TextResult:
        return TextResult(self.request.request_id, self.text, list(self.tokens), self.prompt_len,
                          self.finish_reason or "length", self.seed, self.times)


def pages_needed(engine, req: TextRequest) -> int:
    return engine.pool.pages_for(len(engine.model.text_row(req).ids) + req.max_tokens)


def _seed(req) -> int:
    return req.seed if req.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())


def admit(engine, req: TextRequest, row_type) -> TextState:
    """Pages for the prompt and ``max_tokens`` answer tokens; the stop tokens of the request or the model."""
    seq = engine.model.text_row(req)
    pages = engine.pool.allocate(len(seq.ids) + req.max_tokens)
    stop = frozenset(req.stop_ids) if req.stop_ids is not None else engine.model.stop_ids(req)
    return TextState(req, [row_type(seq, pages, 0)], _seed(req), stop, len(seq.ids))


def cot_pages(engine, plan: CotPlan, image_rows: int, image_row_tokens: int) -> tuple[int, int]:
    """(pages of the CoT row, pages reserved for the image pass's other rows) at the worst case."""
    cot = engine.pool.pages_for(max(len(plan.row.ids) + plan.max_tokens, image_row_tokens))
    return cot, (image_rows - 1) * engine.pool.pages_for(image_row_tokens)


def admit_cot(engine, req, plan: CotPlan, row_type, image_rows: int, image_row_tokens: int) -> TextState:
    """A CoT pass whose row pages (and the reserve) already fit the image pass that follows it."""
    cot, reserve = cot_pages(engine, plan, image_rows, image_row_tokens)
    pages = engine.pool.allocate(cot * engine.pool.page_size)
    try:
        reserved = engine.pool.allocate(reserve * engine.pool.page_size) if reserve else []
    except Exception:
        engine.pool.release(pages)
        raise
    return TextState(req, [row_type(plan.row, pages, 0)], _seed(req), plan.stop_ids, len(plan.row.ids),
                     plan=plan, reserved=reserved)


def next_tokens(states: list[TextState], logits_TV: torch.Tensor) -> list[int]:
    """Each state's next token: a forced one, the plan's greedy choice among its set, or a draw.

    Every drawn token stays on the device until one read of them all: a
    step costs one host sync, not one per answer.
    """
    drawn: dict[int, torch.Tensor] = {}
    for i, (s, logits_V) in enumerate(zip(states, logits_TV)):
        if s.choosing:
            allowed = torch.tensor(s.plan.choose_from, device=logits_V.device)
            drawn[i] = allowed[logits_V[allowed].argmax()]
        elif not s.pending:
            drawn[i] = draw(logits_V, s.sampling, s.seed, len(s.tokens))
    read = dict(zip(drawn, torch.stack(list(drawn.values())).tolist())) if drawn else {}
    out = []
    for i, s in enumerate(states):
        if i not in read:
            read[i], s.pending = s.pending[0], s.pending[1:]
        out.append(int(read[i]))
    return out


def emit(engine, s: TextState, token: int) -> None:
    """Append ``token`` to ``s``; stop at a stop token, after a plan's choice or at ``max_tokens``."""
    was_choice = s.choosing
    s.tokens = s.tokens + (token,)
    forced = s.plan.forced.get(token, ()) if s.plan is not None else ()
    if forced:
        s.pending = s.pending + tuple(forced)
    s.choosing = s.plan is not None and token == s.plan.choose_after and not s.pending
    if was_choice or (token in s.stop_ids and not forced):
        s.finish_reason = "stop"
    elif len(s.tokens) >= s.max_tokens:
        s.finish_reason = "length"
    keep_stop = s.plan is not None  # a CoT keeps its closing marker; an answer drops its stop token
    answer = s.tokens[:-1] if s.finish_reason == "stop" and not keep_stop else s.tokens
    s.text = engine.model.detokenize(list(answer))


@torch.inference_mode()
def decode_step(engine, states: list[TextState]) -> None:
    """One token for every running text row, packed into one forward."""
    t0 = time.perf_counter()
    ids, pos, runs = [], [], []
    for s in states:
        r, at = s.rows[0], s.prompt_len + len(s.tokens) - 1  # the newest token's position
        ids.append(s.tokens[-1])
        pos.append((at, at))
        runs.append(Run(tuple(r.pages), at, at + 1, at + 1))
    # a captured step runs its row bucket: the extra rows copy row 0 (token, position, KV slot), so they route to
    # its experts and write its values to its slot; their outputs are dropped
    fill = engine.text_rows_to(len(states)) - len(states)
    ids, pos, runs = ids + ids[:1] * fill, pos + pos[:1] * fill, runs + runs[:1] * fill
    h_TD = engine.text_forward(engine.model.embed(ids), *engine.model.rope(pos), runs)[: len(states)]
    for s, token in zip(states, next_tokens(states, engine.model.text_logits(h_TD))):
        emit(engine, s, token)
        s.times.denoise += time.perf_counter() - t0
