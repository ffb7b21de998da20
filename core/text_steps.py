"""Text rows on the step engine: a prompt prefilled into the KV pool, then one token per row per step.

A ``TextRequest`` has one row: its prompt (``StepModel.text_row``; images
in the prompt are prefix segments like an edit's). ``admit`` allocates the
pages of the prompt and of ``max_tokens`` more tokens at once, so a running
answer never waits for memory; the prefill's last position gives the first
token. Each later step feeds the row's newest token at its position (one
query over every key before it and itself) and samples the next one
(``omni.sampling``). A row stops at a stop token or after ``max_tokens``.

Steps look one ahead (``decode_step``): a step is launched before the host
reads the tokens of the one before it, feeding a row's unread token from
the device (``TextState.ahead``), so the host's part of a step (the read,
the stop checks, detokenizing, the next tables) runs while the device
computes instead of between steps.

The engine packs the new tokens of every running text row into one forward,
beside (not inside) the denoising forward of the image requests, so text
and image requests share the scheduler and join and leave between steps.
``tokens``, ``text`` and ``ahead`` are rebound, never mutated, at every
step (the scheduler's snapshot of a state is shallow).

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

from .device import upload
from .kv_pool import Run
from .request import StageTimes, TextRequest, TextResult
from .sampling import SamplingParams, draw

INCOMPLETE = "\ufffd"  # what a byte-level detokenizer shows for a character whose bytes are not all there yet


@dataclass(frozen=True)
class CotPlan:
    """How a CoT pass runs: its prompt row, when it stops and what the official code forces."""

    row: object  # RowSpec: the prompt with the assistant turn opened (``<think>`` / ``<recaption>``)
    stop_ids: frozenset[int]
    forced: dict  # token id -> ids fed right after it (a stage transition); such a token never stops
    choose_after: int | None = None  # after this token, one greedy token among ``choose_from``, then stop
    choose_from: tuple[int, ...] = ()
    max_tokens: int = 2048


@dataclass(frozen=True)
class Drawn:
    """The tokens one step drew for its rows: ``tokens_R`` on the device (a step launched before the host
    reads them feeds them from there), ``host_R`` their host copy, readable once the event ``ready`` has
    passed (None: already), and ``logits_RV``, on which a plan's greedy choice among a set is made."""

    tokens_R: torch.Tensor
    host_R: torch.Tensor
    ready: object
    logits_RV: torch.Tensor

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_R.tolist()


@dataclass
class TextState:
    request: TextRequest
    rows: list  # one ``step_state.Row``: the prompt's RowSpec and the pages for prompt + max_tokens
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
    ahead: tuple | None = None  # (Drawn, row): a token drawn by a step whose tokens the host has not read yet
    detok: tuple[int, int] = (0, 0)  # (window start, tokens settled in ``text``): see ``_extend_text``

    @property
    def generated(self) -> int:
        """Tokens generated so far, the unread one included: the index of the next token drawn."""
        return len(self.tokens) + (self.ahead is not None)

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
    if s.done:  # the whole answer once: exact, whatever the detokenizer does across tokens
        keep_stop = s.plan is not None  # a CoT keeps its closing marker; an answer drops its stop token
        answer = s.tokens[:-1] if s.finish_reason == "stop" and not keep_stop else s.tokens
        s.text = engine.model.detokenize(list(answer))
    else:
        _extend_text(engine, s)


def _extend_text(engine, s: TextState) -> None:
    """The answer so far, extended by the text of the newest tokens (what a stream sends).

    Detokenizing the whole answer at every token costs O(n) a token (~0.2 ms
    for 2048 tokens of a byte-level BPE on the development machine, for every
    row at every step). Instead a short window is decoded twice: from the
    first token not yet settled, without and with the new ones; the text they
    add is appended once it does not end in an incomplete character. The
    window starts at a token boundary both decodes share, so a detokenizer's
    handling of its first token (a stripped leading space) cancels out. The
    finished answer is detokenized whole (``emit``), so its text is exact.
    """
    start, settled = s.detok
    before = engine.model.detokenize(list(s.tokens[start:settled]))
    after = engine.model.detokenize(list(s.tokens[start:]))
    if len(after) > len(before) and not after.endswith(INCOMPLETE):
        s.text = s.text + after[len(before):]
        s.detok = (settled, len(s.tokens))


@torch.inference_mode()
def decode_step(engine, states: list[TextState]) -> None:
    """One token for every running text row, packed into one forward.

    With ``engine.text_lookahead`` (the default) the step is launched before
    the host reads the tokens of the step before it: a row whose newest
    token was drawn but not yet read feeds it from the device, and the host
    reads and emits those tokens while this step runs. The device then never
    waits for the host's part of a step (reading the tokens, detokenizing,
    building the next step's tables). A row that stopped at the token read
    here also ran this step; its draw is dropped (its K/V slot is its own).
    Off: each step's tokens are read right after it (one step at a time).
    """
    t0 = time.perf_counter()
    unread = [s for s in states if s.ahead is not None]  # drawn by the last step (none when not looking ahead)
    run = [s for s in states if _needs_step(s)]
    drawn = _launch(engine, run) if run else None
    collect(engine, unread)  # while the step just launched runs
    for i, s in enumerate(run):
        if not s.done:  # one that stopped at the token just read: this step's draw is dropped
            s.ahead = (drawn, i)
    if not engine.text_lookahead:
        collect(engine, run)  # one step at a time: this step's tokens now
    for s in states:
        s.times.denoise += time.perf_counter() - t0


def _needs_step(s: TextState) -> bool:
    """Whether a step must draw another token of ``s``: not when its unread token is its last (``max_tokens``)
    or is to be replaced by the plan's greedy choice, after which it stops."""
    if s.ahead is None:
        return True
    return not s.choosing and s.generated < s.max_tokens


def _newest(s: TextState) -> tuple[int | None, tuple | None]:
    """The token a step feeds for ``s``: from the host (its last token, or a forced one the host knows
    already), else (None, the unread draw) from the device."""
    if s.ahead is None:
        return s.tokens[-1], None
    if s.pending:  # the unread draw is replaced by the forced token: feed that
        return s.pending[0], None
    return None, s.ahead


def _input_ids(engine, newest: list) -> torch.Tensor:
    """``ids_T`` of a step: the host's tokens, and the unread draws gathered on the device from their steps."""
    dev = engine.device
    ids_T = upload([t if t is not None else 0 for t, _ in newest], dev, torch.long)
    groups: dict[int, tuple[Drawn, list[int], list[int]]] = {}  # one gather per step drawn from
    for row, (_, src) in enumerate(newest):
        if src is not None:
            drawn, i = src
            _, rows, picks = groups.setdefault(id(drawn), (drawn, [], []))
            rows.append(row)
            picks.append(i)
    for drawn, rows, picks in groups.values():
        ids_T[upload(rows, dev, torch.long)] = drawn.tokens_R[upload(picks, dev, torch.long)]
    return ids_T


def _launch(engine, run: list[TextState]) -> Drawn:
    """Queue the forward of ``run``'s newest tokens and the draw of their next ones; reads nothing back."""
    newest, pos, runs = [], [], []
    for s in run:
        r, at = s.rows[0], s.prompt_len + s.generated - 1  # the newest token's position
        newest.append(_newest(s))
        pos.append((at, at))
        runs.append(Run(tuple(r.pages), at, at + 1, at + 1))
    # a captured step runs its row bucket: the extra rows copy row 0 (token, position, KV slot), so they route to
    # its experts and write its values to its slot; their outputs are dropped
    fill = engine.text_rows_to(len(run)) - len(run)
    newest, pos, runs = newest + newest[:1] * fill, pos + pos[:1] * fill, runs + runs[:1] * fill
    x_TD = engine.model.embed(_input_ids(engine, newest))
    h_TD = engine.text_forward(x_TD, *engine.model.rope(pos), runs)[: len(run)]
    return draw_step(engine, run, engine.model.text_logits(h_TD))


def draw_step(engine, states: list[TextState], logits_TV: torch.Tensor) -> Drawn:
    """Each row's next token drawn on the device (greedy rows in one argmax), copied to the host without
    waiting. A draw is stateless (``omni.sampling``), so drawing for a row whose next token turns out
    forced changes nothing else."""
    tokens_R = logits_TV.argmax(-1)
    sampled = [i for i, s in enumerate(states) if not s.sampling.greedy]
    if sampled:
        draws = [draw(logits_TV[i], states[i].sampling, states[i].seed, states[i].generated) for i in sampled]
        tokens_R[upload(sampled, tokens_R.device, torch.long)] = torch.stack(draws).to(tokens_R.dtype)
    return Drawn(tokens_R, *engine.to_host(tokens_R), logits_TV)


def collect(engine, states: list[TextState]) -> None:
    """Read each state's unread draw (one wait per step drawn from) and emit its token: the draw, a forced
    token, or the plan's greedy choice among its set (made on the kept logits)."""
    read: dict[int, list[int]] = {}
    for s in states:
        drawn, i = s.ahead
        s.ahead = None
        if s.choosing:
            allowed = torch.tensor(s.plan.choose_from, device=drawn.logits_RV.device)
            token = int(allowed[drawn.logits_RV[i][allowed].argmax()])
        elif s.pending:
            token, s.pending = s.pending[0], s.pending[1:]
        else:
            if id(drawn) not in read:
                read[id(drawn)] = drawn.read()
            token = read[id(drawn)][i]
        emit(engine, s, token)
