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

Shape suffixes: T packed tokens, D hidden, V vocabulary.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .kv_pool import Run
from .request import StageTimes, TextRequest, TextResult
from .sampling import SamplingParams, sample


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

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def sampling(self) -> SamplingParams:
        r = self.request
        return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)

    def result(self) -> TextResult:
        return TextResult(self.request.request_id, self.text, list(self.tokens), self.prompt_len,
                          self.finish_reason or "length", self.seed, self.times)


def pages_needed(engine, req: TextRequest) -> int:
    return engine.pool.pages_for(len(engine.model.text_row(req).ids) + req.max_tokens)


def admit(engine, req: TextRequest, row_type) -> TextState:
    """Pages for the prompt and ``max_tokens`` answer tokens; the stop tokens of the request or the model."""
    seq = engine.model.text_row(req)
    pages = engine.pool.allocate(len(seq.ids) + req.max_tokens)
    seed = req.seed if req.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    stop = frozenset(req.stop_ids) if req.stop_ids is not None else engine.model.stop_ids(req)
    return TextState(req, [row_type(seq, pages, 0)], seed, stop, len(seq.ids))


def emit(engine, s: TextState, logits_V: torch.Tensor) -> None:
    """Sample the next token of ``s`` from its logits; stop at a stop token or at ``max_tokens``."""
    token = sample(logits_V, s.sampling, s.seed, len(s.tokens))
    s.tokens = s.tokens + (token,)
    if token in s.stop_ids:
        s.finish_reason = "stop"
    elif len(s.tokens) >= s.request.max_tokens:
        s.finish_reason = "length"
    answer = s.tokens[:-1] if s.finish_reason == "stop" else s.tokens  # the stop token is not part of the text
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
    h_TD = engine._backbone(engine.model.embed(ids), *engine.model.rope(pos), runs, "none")
    logits_TV = engine.model.text_logits(h_TD)
    for s, logits_V in zip(states, logits_TV):
        emit(engine, s, logits_V)
        s.times.denoise += time.perf_counter() - t0
