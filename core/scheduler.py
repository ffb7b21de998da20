"""Step-level continuous batching over one pipeline (the thread that owns it: ``omni.engine_loop``).

``Scheduler`` is single-threaded policy: ``step()`` is one engine iteration.

    drop cancelled requests (pages freed)
    admit from the FIFO head while max_running, the KV pool and the
        activation budget (max_batch_tokens) allow; prefill each admitted
    one denoising step for every running request, packed into one forward
    decode and release the requests that finished

Requests join and leave only at these step boundaries, so resolutions, step
counts and guidance scales mix freely in one packed forward. ``submit`` and
``cancel`` are thread-safe; everything else runs on the engine thread.

Fairness is arrival order without overtaking: when the head of the queue does
not fit, nothing behind it is admitted, so a large request is never starved
by a stream of small ones; every running request advances one step per
iteration. A request that can never fit (more pages than the whole pool) is
rejected at submit. One that needs more packed tokens than
``max_batch_tokens`` is admitted only when nothing else runs (it runs alone).

Decode off the critical path: a request whose last step ran gives its KV
pages back at once and, when the pipeline says ``concurrent_decode`` (its
decode touches nothing the steps use and needs no lock-step with other
ranks), is decoded on the scheduler's own decode thread while the engine
thread goes on stepping the others; it is reported finished by the first
``step()`` after its decode ended. Otherwise (``decode_thread=False``, or a
multi-rank replica whose tiles are spread over its ranks) it decodes inline.

Failure isolation: an exception while admitting, prefilling, stepping or
decoding one request fails only that request (its pages freed). A packed
step that raises is retried one request at a time from a snapshot of each
state, so the culprit is found and the others lose nothing.

Batch invariance: each admitted request is prefilled on its own by default
(``pack_prefill=False``): a prefix forward packed with other prefixes is
shaped by its company (GEMM kernels are picked by M; CPU threads split the
packed rows at size-dependent points), and prefill is a small share of the
work next to the denoising steps. With batch-invariant kernels (the
reference platform with one intra-op thread) the same seed then gives the
bitwise same image alone or under load; with several CPU threads, vectorised
elementwise kernels (SiLU, exp) round the rows at a thread boundary
differently, so packed latents differ in the last bits (tests/serving checks
both).

Text requests (``TextRequest``) run in the same loop: their step is one
token, they finish without a decode (their result is the answer), and
``Ticket.updates`` receives the answer so far after every step (streaming).

The pipeline protocol: ``pool`` (a KVPool), ``pages_needed(req)``,
``admit(req) -> state``, ``prefill(states)``, ``denoise_step(states)``,
``decode(state) -> uint8 [H, W, 3]``, ``release(state)``, ``step_tokens(req)``
(packed tokens one step of the request adds on this worker); optional
``concurrent_decode`` (default False). A state has
``.done``, ``.request``, ``.seed``, ``.times`` (StageTimes), and
``denoise_step`` must rebind, not mutate in place, what it advances (the
snapshot is a shallow copy of the state's attributes).
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import threading
import time
from typing import Callable

from . import compile_pass
from .kv_pool import KVPoolExhausted
from .request import ImageRequest, ImageResult, TextRequest
from .scheduler_errors import QueueFull, RequestCancelled, RequestInvalid, RequestTooLarge
from .ticket import Cost, Ticket, restore_state, settle, snapshot_state

log = logging.getLogger("omni.scheduler")


def default_request(recipe, **changes) -> ImageRequest:
    """The request ``recipe.defaults`` describes (size, steps, guidance, shift, template, system prompt)."""
    d = recipe.defaults
    w, h = d.width_height
    kw = dict(prompt="a red cat on green grass", height=h, width=w, steps=d.steps, guidance=d.guidance,
              shift=d.shift, template=d.template, system_prompt=d.system_prompt, seed=0)
    return ImageRequest(**(kw | changes))


class Scheduler:
    """FIFO step-level batching under a KV-page and a packed-token budget (see module docstring)."""

    def __init__(self, pipeline, *, max_running: int = 8, max_queue: int | None = None,
                 max_batch_tokens: int | None = None, pack_prefill: bool = False, decode_thread: bool = False,
                 text_tokens_per_image_step: int = 1, compile_first: bool = False,
                 clock: Callable[[], float] = time.perf_counter):
        self.pipeline, self.pool = pipeline, pipeline.pool
        self.max_running, self.max_queue = max_running, max_queue
        self.max_batch_tokens, self.pack_prefill, self.clock = max_batch_tokens, pack_prefill, clock
        self.text_tokens_per_image_step = text_tokens_per_image_step
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.running: list[Ticket] = []
        self.admitting: list[Ticket] = []  # taken off the queue, not yet running (admit + prefill)
        self._lock = threading.RLock()  # re-entered: cancel() holds it while it resolves a waiting ticket
        self.initial_free_pages = self.pool.free_pages
        self.stats = collections.Counter()  # steps, step_tokens, admitted, finished, failed, cancelled, rejected
        self._service_s: float | None = None  # moving average of admitted -> finished seconds
        self.build_s: float | None = None  # the pipeline's build before it (set by ``serving_scheduler``)
        self.warm_up_s: float | None = None  # what ``warm_up`` took (None: no warm-up ran)
        self.compile_first = compile_first  # ``warm_up`` runs its requests in a compile pass first
        self.compile_pass_s: float | None = None  # what that pass took (None: none ran)
        threaded = decode_thread and getattr(pipeline, "concurrent_decode", False)
        self._decoder = concurrent.futures.ThreadPoolExecutor(1, "omni-decode") if threaded else None
        self._decoded: collections.deque[Ticket] = collections.deque()  # settled on the decode thread

    @classmethod
    def from_recipe(cls, pipeline, recipe, **overrides) -> "Scheduler":
        """The scheduler ``recipe.serving`` describes (max_running, max_queue, max_batch_tokens)."""
        s = recipe.serving
        kw = dict(max_running=s.max_running, max_queue=s.max_queue, max_batch_tokens=s.max_batch_tokens,
                  decode_thread=True, text_tokens_per_image_step=s.text_tokens_per_image_step,
                  compile_first=s.compile_first)
        sched = cls(pipeline, **(kw | overrides))
        w, h = recipe.defaults.width_height
        need = sched.cost(default_request(recipe)).step_tokens
        if sched.max_batch_tokens is not None and need > sched.max_batch_tokens:
            log.warning("serving.max_batch_tokens=%d is below one default %dx%d request (%d packed tokens per "
                        "step): such requests run one at a time; raise it to batch them",
                        sched.max_batch_tokens, w, h, need)
        return sched

    def warm_up(self, *requests, compile_ahead: tuple = ()) -> float:
        """Run ``requests`` to completion, one after another, before serving (engine thread, nothing else
        submitted yet): the JIT compiles, autotuning and graph captures of their shapes happen here instead of
        in the first users' requests. With ``compile_first`` they run once inside the pipeline's compile pass
        first (``omni.compile_pass``), with ``compile_ahead``: requests that only that pass runs (a one-shot
        job's own first request, which then runs as users' do). Raises what a request raised; the counters start from
        zero afterwards. Returns seconds."""
        t0 = time.perf_counter()
        if self.compile_first:
            self.compile_pass_s = self._compile_pass((*requests, *compile_ahead))
        for request in requests:
            self._run_to_end(request)
        self.stats.clear()
        self._service_s = None
        self.warm_up_s = time.perf_counter() - t0
        return self.warm_up_s

    def _run_to_end(self, request) -> None:
        ticket = self.submit(request)
        while not ticket.future.done():
            self.step()
        ticket.result()

    def _compile_pass(self, requests) -> float | None:
        """``requests`` run once inside the pipeline's compile pass (``compile_pass.run``); seconds, or None
        where the pipeline has none."""
        scope = getattr(self.pipeline, "compile_pass", lambda: None)()
        return compile_pass.run(scope, requests, self._run_to_end)

    # ------------------------------------------------------------ any thread

    def cost(self, req: ImageRequest) -> Cost:
        """Pages and packed step tokens of ``req``; raises RequestTooLarge if it can never fit, RequestInvalid
        if the model refuses it (building its rows raised a ValueError, which names the field)."""
        try:
            cost = Cost(self.pipeline.pages_needed(req), self.pipeline.step_tokens(req))
        except (ValueError, KeyError) as e:
            raise RequestInvalid(f"request {req.request_id}: {e}") from None
        if cost.pages > self.pool.num_pages:
            raise RequestTooLarge(
                f"request needs {cost.pages} KV pages ({cost.pages * self.pool.page_size} tokens) but the whole "
                f"pool has {self.pool.num_pages}; use a smaller image or prompt, or raise kv_cache.budget_bytes")
        return cost

    def submit(self, req: ImageRequest) -> Ticket:
        return self.submit_many([req])[0]

    def submit_many(self, reqs: list[ImageRequest]) -> list[Ticket]:
        """Queue ``reqs`` together or not at all (QueueFull); thread-safe."""
        costs = [self.cost(r) for r in reqs]
        with self._lock:
            if self.max_queue is not None:
                free_slots = max(0, self.max_running - len(self.running) - len(self.admitting))
                room = self.max_queue + free_slots - len(self.waiting)
                if len(reqs) > room:
                    self.stats["rejected"] += len(reqs)
                    raise QueueFull(f"server busy: {len(self.waiting)} waiting, {len(self.running)} running "
                                    f"(serving.max_queue={self.max_queue})", self.retry_after_s())
            now = self.clock()
            tickets = [Ticket(r, c, now) for r, c in zip(reqs, costs)]
            self.waiting.extend(tickets)
        return tickets

    def cancel(self, ticket: Ticket) -> None:
        """Cancel ``ticket``: at once if waiting, else at the next step boundary (pages freed)."""
        ticket.mark_cancelled()
        with self._lock:
            if ticket in self.waiting:
                self.waiting.remove(ticket)
                self._resolve_cancelled(ticket)

    def retry_after_s(self) -> int:
        """Seconds a client should wait before retrying: one service time per batch ahead of it."""
        per_batch = self._service_s or 1.0
        batches_ahead = 1 + len(self.waiting) // self.max_running
        return max(1, math.ceil(per_batch * batches_ahead))

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.admitting or self.running)

    # ------------------------------------------------------------ engine thread

    def step(self) -> list[Ticket]:
        """One engine iteration; returns the tickets resolved in it (done, failed or cancelled)."""
        finished: list[Ticket] = self._drain_decoded()
        self._reap_cancelled(finished)
        admitted = self._admit(finished)
        if admitted:
            self._prefill(admitted, finished)
            self._publish()  # a text answer's first token comes from its prefill
        self.admitting = []
        if self.running:
            self._denoise(finished)
            self._publish()
            self._finish_done(finished)
        return finished

    def close(self) -> None:
        """Wait for the decodes in flight (their requests resolve); the scheduler steps no more."""
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)

    def fail_all(self, error: BaseException) -> None:
        """Resolve every waiting and running ticket with ``error`` and free their pages."""
        with self._lock:
            tickets, self.waiting = list(self.waiting), collections.deque()
        tickets += self.admitting + self.running
        self.admitting, self.running = [], []
        for t in tickets:
            self._release(t)
            settle(t.future, error=error)

    def _reap_cancelled(self, finished: list[Ticket]) -> None:
        for t in [t for t in self.running if t.cancelled]:
            self.running.remove(t)
            self._release(t)
            self._resolve_cancelled(t)
            finished.append(t)

    def _resolve_cancelled(self, t: Ticket) -> None:
        with self._lock:  # also called from the decode thread
            self.stats["cancelled"] += 1
        settle(t.future, error=RequestCancelled(f"request {t.request_id} was cancelled"))
        log.info("request %s cancelled (step %s)", t.request_id, getattr(t.state, "step", "queued"))

    def _fits(self, t: Ticket, admitted: list[Ticket]) -> bool:
        active = self.running + admitted
        if len(active) >= self.max_running or t.cost.pages > self.pool.free_pages:
            return False
        if self.max_batch_tokens is None or not active:
            return True  # one request over the token budget still runs, alone
        return sum(a.cost.step_tokens for a in active) + t.cost.step_tokens <= self.max_batch_tokens

    def _admit(self, finished: list[Ticket]) -> list[Ticket]:
        admitted: list[Ticket] = []
        while True:
            with self._lock:
                if not self.waiting or not self._fits(self.waiting[0], admitted):
                    return admitted
                t = self.waiting.popleft()
                self.admitting.append(t)
            if self._try(t, finished, "admit", lambda: setattr(t, "state", self.pipeline.admit(t.request))):
                t.admitted_at = self.clock()
                t.state.times.queue = t.admitted_at - t.submitted_at
                self.stats["admitted"] += 1
                admitted.append(t)

    def _prefill(self, admitted: list[Ticket], finished: list[Ticket]) -> None:
        if self.pack_prefill and len(admitted) > 1:
            try:
                self.pipeline.prefill([t.state for t in admitted])
                self.running += admitted
                return
            except Exception:
                log.warning("packed prefill of %d requests failed; retrying one at a time", len(admitted))
        for t in admitted:
            if self._try(t, finished, "prefill", lambda: self.pipeline.prefill([t.state])):
                self.running.append(t)

    def _denoise(self, finished: list[Ticket]) -> None:
        """One step of every running request, then extra text-only steps while images are denoising."""
        self._step(list(self.running), finished)
        texts = [t for t in self.running if hasattr(t.state, "tokens")]
        if not texts or len(texts) == len(self.running):
            return
        for _ in range(self.text_tokens_per_image_step - 1):  # a token must not wait for every image step
            live = [t for t in texts if t in self.running and not t.state.done]
            if not live:
                return
            self._publish()
            self._step(live, finished)

    def _step(self, tickets: list[Ticket], finished: list[Ticket]) -> None:
        """``denoise_step`` over ``tickets``; a failed packed step is retried one request at a time."""
        saved = [snapshot_state(t.state) for t in tickets]
        try:
            self.pipeline.denoise_step([t.state for t in tickets])
        except Exception as e:
            if len(tickets) == 1:
                self.running.remove(tickets[0])
                self._fail(tickets[0], e, "denoise", finished)
                return
            log.warning("packed step of %d requests failed (%s); retrying one at a time", len(tickets), e)
            for t, s in zip(tickets, saved):
                restore_state(t.state, s)
            for t in tickets:
                if not self._try(t, finished, "denoise", lambda: self.pipeline.denoise_step([t.state])):
                    self.running.remove(t)
        else:
            self.stats["steps"] += 1
            self.stats["step_tokens"] += sum(t.cost.step_tokens for t in tickets)

    def _publish(self) -> None:
        """Each running text request's answer so far, to its ticket's ``updates`` when it changed."""
        for t in self.running:
            text = getattr(t.state, "text", None)
            if text is not None:
                t.publish(text)

    def _next_pass(self, t: Ticket) -> None:
        """A finished CoT pass continues as its image pass (same ticket, pages handed over), prefilled."""
        t.state = self.pipeline.continue_with(t.state)
        self.pipeline.prefill([t.state])

    def _finish_done(self, finished: list[Ticket]) -> None:
        for t in [t for t in self.running if t.state.done and getattr(t.state, "plan", None) is not None]:
            if not self._try(t, finished, "image pass", lambda: self._next_pass(t)):
                self.running.remove(t)
        for t in [t for t in self.running if t.state.done]:
            self.running.remove(t)
            if t.cancelled:  # its client left during the last step: a decode nobody will read is not run
                self._release(t)
                self._resolve_cancelled(t)
                finished.append(t)
                continue
            if isinstance(t.request, TextRequest):  # nothing to decode: the answer is the result
                self._finish_text(t)
                finished.append(t)
                continue
            if self._decoder is None or compile_pass.active():  # the pass's scope is this thread's
                if self._try(t, finished, "decode", lambda: self._decode(t)):
                    finished.append(t)
                continue
            self._release(t)  # on the engine thread (a multi-rank release is mirrored); decode needs no pages
            self._decoder.submit(self._decode_off_thread, t)

    def _decode_off_thread(self, t: Ticket) -> None:
        done: list[Ticket] = []
        if t.cancelled:  # its client left while it waited for the decode thread
            self._resolve_cancelled(t)
            done.append(t)
        elif self._try(t, done, "decode", lambda: self._decode(t)):
            done.append(t)
        self._decoded.extend(done)

    def _drain_decoded(self) -> list[Ticket]:
        drained = []
        while self._decoded:
            drained.append(self._decoded.popleft())
        return drained

    def _finish_text(self, t: Ticket) -> None:
        self._release(t)
        t.finished_at = self.clock()
        with self._lock:
            self.stats["finished"] += 1
        settle(t.future, result=t.state.result())

    def _decode(self, t: Ticket) -> None:
        image = self.pipeline.decode(t.state)
        s, r = t.state, t.request
        self._release(t)
        t.finished_at = self.clock()
        took = t.finished_at - t.admitted_at
        with self._lock:  # the decode thread and the engine thread both finish requests
            self._service_s = took if self._service_s is None else 0.8 * self._service_s + 0.2 * took
            self.stats["finished"] += 1
        latents = s.latents_1Chw.detach().cpu() if r.return_latents else None
        revised = s.request.cot_text if r.bot_task != "image" else None  # the image pass's request holds the CoT
        settle(t.future, result=ImageResult(r.request_id, image.numpy(), s.seed, image.shape[0], image.shape[1],
                                             r.steps, s.times, latents, revised))

    def _try(self, t: Ticket, finished: list[Ticket], stage: str, fn: Callable[[], None]) -> bool:
        """Run ``fn`` for one request; on an exception fail that request only. True if it succeeded."""
        try:
            fn()
            return True
        except Exception as e:
            self._fail(t, e, stage, finished)
            return False

    def _fail(self, t: Ticket, error: Exception, stage: str, finished: list[Ticket]) -> None:
        self._release(t)
        with self._lock:
            self.stats["failed"] += 1
        log.error("request %s failed in %s: %s: %s", t.request_id, stage, type(error).__name__, error,
                  exc_info=error)
        if isinstance(error, KVPoolExhausted):  # pages_needed disagreed with admit: a pipeline bug, still isolated
            error = RuntimeError(f"KV pool accounting mismatch for request {t.request_id}: {error}")
        settle(t.future, error=error)
        finished.append(t)

    def _release(self, t: Ticket) -> None:
        if t.state is not None and not t.released:
            t.released = True
            self.pipeline.release(t.state)
