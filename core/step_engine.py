"""The packed denoise engine over a paged KV pool (DESIGN.md, "The model").

Per request: build its rows (``StepModel.build_rows``), run their prefixes
once (causal prefill, K/V kept in the pool), then at every denoising step run
only each row's step block against its cached prefix. The blocks of all
active requests (any resolution, step count, guidance) pack into one
forward; its output is split back per request, turned into velocities by the
model and, after guidance, into one sampler step. This is the scheduler's
pipeline protocol (``omni.scheduler``); what is specific to a model lives
behind ``omni.step_model.StepModel``.

Around the forward: the step cache (``omni.step_cache``) skips the backbone
of requests whose input barely moved; under ``graph.mode: capture`` the
packed backbone is replayed from a graph per batch signature
(``omni.step_graphs``), and so is the VAE per latent shape. The runtime
(``omni.parallel.runtime``: one device or a mesh) says which rows this
worker computes (CFG parallel), runs each packed forward (sequence
parallel), exchanges the rows' predictions after a step and spreads VAE
tiles over the replica. This file never touches torch.distributed itself.

Shape suffixes: T packed tokens, D hidden, H head dim (rope tables), B rows,
C latent channels, h/w latent grid, 3HW pixels.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Callable

import torch

from . import text_steps
from .compile_pass import compile_pass
from .kv_pool import KVPool, PoolContext, Run
from .request import ImageRequest, TextRequest
from .step_cache import StepCache, after_step, plan_skips
from .step_graphs import StepGraphs, geometric_keys, padded_keys, row_bucket, step_key, text_key
from .step_model import RowSpec, StepModel
from .step_state import RequestState, Row, StepBlock, common_prefix
from .vae_tiling import TileLanes

if TYPE_CHECKING:
    from .parallel.runtime import Runtime


class StepEngine:
    """Packed prefill and denoising steps of one worker over its KV pool; no scheduling policy.

    ``model``: the model side (``StepModel``). ``runtime``: ``SingleDevice`` or this rank's
    ``ParallelRuntime``. ``step_graphs`` / ``vae_graphs`` / ``text_graphs`` (the text rows' decode steps):
    ``StepGraphs`` under ``graph.mode: capture`` (None: eager). ``synchronize``: waits for the device
    (``DeviceServices.synchronize``); called where a stage time is read, since kernels and graph replays run
    asynchronously (without it a replayed step's time shows up in whatever waits next, the VAE decode).
    ``to_host(t)``: ``(host copy of t, event to wait on before reading it, or None)`` without waiting
    (``DeviceServices.to_host_async``); the decode steps read their tokens through it.
    ``memory_stats()``: the device's memory in bytes by name (``DeviceServices.memory_stats``: allocated,
    reserved, peak; a host reports its peak RSS), read by the server's /metrics at scrape time: torch's
    allocator statistics are host-side counters (no device call), so a scrape does not touch a capture
    running on the engine thread.
    ``vae_tiles``: ``(tile, overlap)`` latents, None decodes whole. ``offloaders``:
    ``omni.offload.LayerOffloader`` objects (their hooks do the work; kept here for their stats).
    ``on_velocity(state, v_BChw)``: called with every row's velocity of a request after each step (tests
    record them).
    ``compile_scope()``: the platform's compile scope (``Platform.compile_scope``: a context manager, or None
    where the platform has none), which ``compile_pass`` wraps for a server's warm-up.
    """

    def __init__(self, model: StepModel, *, pool: KVPool, runtime: Runtime, device, paged: bool,
                 step_cache: float = 0.0, step_graphs: StepGraphs | None = None,
                 vae_graphs: StepGraphs | None = None, text_graphs: StepGraphs | None = None,
                 vae_tiles: tuple[int, int] | None = None, vae_lanes: TileLanes | None = None, offloaders=(),
                 on_velocity: Callable[[RequestState, torch.Tensor], None] | None = None,
                 synchronize: Callable[[], None] | None = None, to_host: Callable | None = None,
                 memory_stats: Callable[[], dict] | None = None, compile_scope: Callable | None = None):
        self.model, self.pool, self.runtime = model, pool, runtime
        self.memory_stats = memory_stats or dict  # the device's byte counts, read by /metrics at scrape time
        self.synchronize = synchronize or (lambda: None)  # stage times are the device's, not the launch queue's
        self.to_host = to_host or (lambda t: (t.cpu(), None))  # (host copy, event to wait on): see text_steps.Drawn
        self.text_lookahead = True  # decode steps launched before the last one's tokens are read (text_steps)
        self.device, self.paged, self.step_cache = torch.device(device), paged, step_cache
        self.step_graphs, self.vae_graphs, self.text_graphs = step_graphs, vae_graphs, text_graphs
        self.text_row_buckets = True  # decode graphs per row and key bucket; off: per exact count (benchmarks)
        self.vae_tiles, self.vae_lanes = vae_tiles, vae_lanes or TileLanes()  # lanes: tiles on several streams
        self.offloaders, self.on_velocity = list(offloaders), on_velocity
        self.compile_scope = compile_scope or (lambda: None)

    def compile_pass(self):
        """A context for the warm-up's compile pass (``omni.compile_pass``), or None where the platform has no
        compile scope (nothing would be gathered: no pass runs)."""
        scope = self.compile_scope()
        return None if scope is None else compile_pass(scope)

    @property
    def concurrent_decode(self) -> bool:
        """Whether ``decode`` may run on another thread while this one runs steps of other requests.

        Not when VAE tiles are spread over the ranks of a multi-rank replica
        (that decode is a collective, mirrored on every rank in lock-step with
        the steps), nor under graph capture: a capture must not overlap other
        work of the device, and step and VAE graphs draw on the platform's
        graph memory pools by the same ids.
        """
        spread = self.vae_tiles is not None and self.runtime.replica_size > 1
        return not spread and self.step_graphs is None and self.vae_graphs is None and self.text_graphs is None

    # ---------------------------------------------------------------- admission
    def _here(self, seqs: list[RowSpec]) -> list[RowSpec]:
        """The rows this worker computes: all of them, unless CFG parallel puts rows on other ranks."""
        return [seqs[i] for i in self.runtime.cfg_rows(len(seqs))]

    def step_tokens(self, req: ImageRequest | TextRequest) -> int:
        if isinstance(req, TextRequest):
            return 1
        return sum(self.model.block_len(s) for s in self._here(self.model.build_rows(req)))

    def pages_needed(self, req: ImageRequest | TextRequest) -> int:
        if isinstance(req, TextRequest):
            return text_steps.pages_needed(self, req)
        if req.bot_task != "image":
            return sum(text_steps.cot_pages(self, *self._cot_layout(req)))
        rows = self._here(self.model.build_rows(req))
        return sum(self.pool.pages_for(s.prefix_len + self.model.block_len(s)) for s in rows)

    def admit(self, req: ImageRequest | TextRequest):
        """Allocate pages for every row here (all or nothing) and draw the initial noise (text: see text_steps)."""
        if isinstance(req, TextRequest):
            return text_steps.admit(self, req, Row)
        if req.bot_task != "image":
            plan, image_rows, row_tokens = self._cot_layout(req)
            return text_steps.admit_cot(self, req, plan, Row, image_rows, row_tokens)
        seqs = self.model.build_rows(req)
        rows = self._allocate(self._here(seqs))
        seed = req.seed if req.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        return RequestState(req, rows, self.model.noise(seed, seqs[0]), self.model.sigmas(req), seed,
                            total_rows=len(seqs), cache=self._step_cache_of(req))

    def _step_cache_of(self, req: ImageRequest) -> StepCache:
        """The request's step cache: its own threshold, else the engine's."""
        return StepCache(self.step_cache if req.step_cache is None else req.step_cache)

    def _allocate(self, seqs: list[RowSpec]) -> list[Row]:
        rows: list[Row] = []
        try:
            for s in seqs:
                n = self.model.block_len(s)
                rows.append(Row(s, self.pool.allocate(s.prefix_len + n), n))
        except Exception:
            self._release_rows(rows)
            raise
        return rows

    def _cot_layout(self, req: ImageRequest) -> tuple:
        """(CoT plan, image rows on this worker, worst-case tokens of one image-pass row)."""
        plan = self.model.cot_plan(req)
        return plan, len(self._here(self.model.build_rows(req))), self.model.image_row_bound(req, plan)

    def continue_with(self, s) -> RequestState:
        """The image pass after a CoT pass: its rows take the CoT row's pages (and its K/V where the
        tokens agree) and the reserve; only what differs is prefilled again (``Row.cached``)."""
        req = self.model.image_pass(s.request, s.tokens)
        seqs = self.model.build_rows(req)
        here = self.runtime.cfg_rows(len(seqs))
        src = s.rows[0]
        P = len(src.seq.ids)  # the CoT row wrote the prompt and every generated token but the last
        fed = tuple(zip(tuple(src.seq.ids) + s.tokens[:-1],
                        tuple(src.seq.pos_yx) + tuple((i, i) for i in range(P, P + len(s.tokens) - 1))))
        free, rows = {0: list(src.pages), 1: list(s.reserved)}, []
        extra: list[int] = []
        try:
            for i in here:
                seq, n = seqs[i], self.model.block_len(seqs[i])
                need, own = self.pool.pages_for(seq.prefix_len + n), free[min(i, 1)]
                pages, free[min(i, 1)] = own[:need], own[need:]
                if len(pages) < need:
                    more = self.pool.allocate((need - len(pages)) * self.pool.page_size)
                    extra, pages = extra + more, pages + more
                rows.append(Row(seq, pages, n, cached=common_prefix(fed, seq)))
        except Exception:
            self.pool.release(extra)
            raise
        for i, r in zip(here, rows):
            if i != 0:  # did not take the CoT row's pages: copy the K/V it wrote before the rows diverge
                self.pool.copy_prefix(src.pages, r.pages, r.cached)
        self.pool.release(free[0] + free[1])
        s.rows, s.reserved = [], []  # handed over
        return RequestState(req, rows, self.model.noise(s.seed, seqs[0]), self.model.sigmas(req), s.seed,
                            total_rows=len(seqs), times=s.times, cache=self._step_cache_of(req))

    def release(self, state: RequestState) -> None:
        self._release_rows(state.rows)
        self.pool.release(state.reserved)  # a CoT pass's pages for the image pass that did not come
        state.rows, state.reserved = [], []
        if hasattr(state, "ahead"):  # an answer released mid-way: drop its unread draw's tensors
            state.ahead = None

    def _release_rows(self, rows: list[Row]) -> None:
        for r in rows:
            self.pool.release(r.pages)

    # ---------------------------------------------------------------- forwards
    @torch.inference_mode()
    def prefill(self, states: list) -> None:
        """Every row's prefix, segment by segment (``StepModel.prefix_segments``); only its K/V are kept.

        Segment i of every row runs in one forward (per mask kind), after
        segment i - 1 of every row: a segment's keys before it are in the pool.
        A text-to-image prefix is one causal segment, so one forward. A text
        row's prefix is its whole prompt: its last position's output gives
        the answer's first token.
        """
        phases: dict[tuple[int, str], list] = defaultdict(list)
        for s in states:
            t_in = time.perf_counter()
            xs = self.model.prefix_input(s.request, s.seed, [r.seq for r in s.rows], min(r.cached for r in s.rows))
            s.times.conditioning += time.perf_counter() - t_in
            for r, x_LD in zip(s.rows, xs):
                for i, (a, b, mask) in enumerate(self.model.prefix_segments(r.seq)):
                    a = a if mask == "none" and r.cached < b else max(a, r.cached)  # cached: K/V in place
                    if b > a:
                        phases[(i, mask)].append((r, x_LD[a:b], a, b))
        t0 = time.perf_counter()
        last = {}  # id(row) -> its prefix's last hidden state
        for key in sorted(phases):
            h_TD, ends = self._prefill_phase(phases[key], key[1]), 0
            for r, x, _, b in phases[key]:
                ends += x.shape[0]
                if b == r.seq.prefix_len:
                    last[id(r)] = h_TD[ends - 1]
        self._first_tokens([s for s in states if isinstance(s, text_steps.TextState)], last)
        self.synchronize()
        for s in states:  # the forwards are shared: each request waited for all of them
            s.times.prefill += time.perf_counter() - t0

    def _prefill_phase(self, items: list, mask: str) -> torch.Tensor:
        """One forward over ``(row, x_LD, start, stop)`` segments: queries [start, stop) see keys [0, stop)."""
        x_TD = torch.cat([x for _, x, _, _ in items])
        pos = [p for r, _, a, b in items for p in r.seq.pos_yx[a:b]]
        runs = [Run(tuple(r.pages), a, b, b) for r, _, a, b in items]
        return self._backbone(x_TD, *self.model.rope(pos), runs, mask)

    def _first_tokens(self, states: list, last: dict) -> None:
        if states:
            logits_TV = self.model.text_logits(torch.stack([last[id(s.rows[0])] for s in states]))
            drawn = text_steps.draw_step(self, states, logits_TV)
            for i, s in enumerate(states):
                s.ahead = (drawn, i)
            text_steps.collect(self, states)

    def read_text(self, states: list) -> None:
        """Read and emit the tokens of ``states`` that steps drew but the host has not read yet (decode steps
        look one ahead, ``text_steps.decode_step``): for a caller that stops stepping a text row before it is
        done and wants every token its steps drew. Launches nothing. The scheduler never needs it (it steps
        a row until it is done), and a multi-rank replica's driver does not mirror it (``parallel.driver``):
        call it on every rank's engine alike."""
        text_steps.collect(self, [s for s in states if getattr(s, "ahead", None) is not None])

    def denoise_step(self, states: list) -> None:
        """One step of every running request: a sampler step per image request (their rows share one
        forward), one token per text request (their rows share another)."""
        texts = [s for s in states if isinstance(s, text_steps.TextState) and not s.done]
        if texts:
            text_steps.decode_step(self, texts)
        images = [s for s in states if not isinstance(s, text_steps.TextState)]
        if images:
            self._denoise(images)

    @torch.inference_mode()
    def _denoise(self, states: list[RequestState]) -> None:
        t0 = time.perf_counter()
        blocks = [self._block(s) for s in states]
        skip = plan_skips([s.cache for s in states], [b.x_TD for b in blocks], [s.edge for s in states])
        computed = [i for i, k in enumerate(skip) if not k]
        h_TD = self._forward([blocks[i] for i in computed], [states[i] for i in computed])
        preds = self.runtime.exchange_predictions(self._velocities(states, blocks, skip, h_TD),
                                                  [s.total_rows for s in states])
        for s, v_BChw in zip(states, preds):
            self._update(s, v_BChw)
        self.synchronize()
        for s in states:
            s.times.denoise += time.perf_counter() - t0
            s.times.steps_skipped = s.cache.skipped

    def _block(self, s: RequestState) -> StepBlock:
        """This request's step input over its rows here, at its current noise level."""
        for r in s.rows:
            if r.block_rope is None:  # positions never change: build the tables once per request
                r.block_rope = self.model.rope(r.seq.pos_yx[r.seq.prefix_len: r.tokens])
        runs = [Run(tuple(r.pages), q0, q1, q1) for r in s.rows for q0, q1 in self.model.block_spans(r.seq)]
        x_TD = self.model.block_input(s.latents_1Chw, s.sigma, [r.seq for r in s.rows],
                                      sigma_next=float(s.sigmas[s.step + 1]), guidance=s.request.guidance)
        return StepBlock(x_TD, [r.block_rope for r in s.rows], runs)

    def _forward(self, blocks: list[StepBlock], states: list[RequestState]) -> torch.Tensor | None:
        """The packed backbone over ``blocks``; replayed from the graph of their signature under capture."""
        if not blocks:
            return None
        b = StepBlock.pack(blocks)
        cos_TH, sin_TH = b.rope_TH()
        if self.step_graphs is None:
            return self._backbone(b.x_TD, cos_TH, sin_TH, b.runs, "none")
        keys_to = padded_keys(b.runs, self.step_graphs.key_bucket, self.paged, self.pool.page_size)
        return self.step_graphs.run(step_key(states, keys_to), b.x_TD, self.model.backbone,
                                    lambda: (cos_TH, sin_TH, self._context(b.runs, "none", keys_to)))

    def text_rows_to(self, n: int) -> int:
        """The rows a decode step of ``n`` text rows runs: ``n`` eagerly; under capture its ``row_bucket``
        (unless ``text_row_buckets`` is off), so a changing number of answers replays a few graphs."""
        if self.text_graphs is None or not self.text_row_buckets:
            return n
        return row_bucket(n)

    def text_forward(self, x_TD, cos_TH, sin_TH, runs: list[Run]) -> torch.Tensor:
        """The packed decode forward of the text rows (one query each); under capture, replayed from the graph
        of their row count and key bucket (the output is valid until the next replay: use it at once)."""
        graphs = self.text_graphs
        if graphs is None:
            return self._backbone(x_TD, cos_TH, sin_TH, runs, "none")
        keys_to = padded_keys(runs, graphs.key_bucket, self.paged, self.pool.page_size)
        keys_to = geometric_keys(keys_to, graphs.key_bucket) if self.text_row_buckets else keys_to
        return graphs.run(text_key(runs, keys_to), x_TD, self.model.backbone,
                          lambda: (cos_TH, sin_TH, self._context(runs, "none", keys_to)))

    def _backbone(self, x_TD, cos_TH, sin_TH, runs: list[Run], mask: str) -> torch.Tensor:
        """The model over one packed forward whose attention reads and writes the KV pool."""
        return self.runtime.run_backbone(self.model, x_TD, cos_TH, sin_TH, pool=self.pool, runs=runs, mask=mask,
                                         paged=self.paged, device=self.device)

    def _context(self, runs: list[Run], mask: str, keys_to: int = 0) -> PoolContext:
        return PoolContext(self.pool, runs, mask=mask, paged=self.paged, device=self.device, keys_to=keys_to)

    def _velocities(self, states, blocks, skip, h_TD) -> list[torch.Tensor]:
        """Per request, ``v_BChw`` of its rows here; a skipped request's output comes from its step cache."""
        offset, preds = 0, []
        for s, b, k in zip(states, blocks, skip):
            n = 0 if k else b.x_TD.shape[0]
            h_req = after_step(s.cache, b.x_TD, None if k else h_TD[offset: offset + n])
            offset += n
            preds.append(self.model.velocity(h_req, [r.seq for r in s.rows], s.sigma))
        return preds

    def _update(self, s: RequestState, v_BChw: torch.Tensor) -> None:
        """Guidance over every row of the request, then one sampler step."""
        if self.on_velocity is not None:
            self.on_velocity(s, v_BChw)
        s.latents_1Chw = self.model.sample_step(s.latents_1Chw, v_BChw, s.sigmas[s.step], s.sigmas[s.step + 1],
                                                s.request.guidance)
        s.step += 1

    # ---------------------------------------------------------------- output
    @torch.inference_mode()
    def decode(self, s: RequestState) -> torch.Tensor:
        """Latents -> uint8 ``[H, W, 3]`` on the host (quantized to uint8 on the device, laid out on the host)."""
        t0 = time.perf_counter()
        x_13HW = self._decode_latents(s.latents_1Chw)
        img = ((x_13HW[0] / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        out = img.cpu().permute(1, 2, 0).contiguous()  # move 1 byte/pixel, then lay out HWC on the host
        s.times.vae += time.perf_counter() - t0
        return out

    def _decode_latents(self, z_1Chw: torch.Tensor) -> torch.Tensor:
        decode = self._vae_decoder()
        if self.vae_tiles is None:
            return decode(z_1Chw)
        tile, overlap = self.vae_tiles
        return self.runtime.tiled_decode(decode, z_1Chw, tile=tile, overlap=overlap,
                                         factor=self.model.pixels_per_latent, lanes=self.vae_lanes)

    def _vae_decoder(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """latents -> pixels; replayed from a graph per latent shape under graph.mode: capture.

        A replay returns the graph's static output, which the next replay
        overwrites: callers consume it (blend a tile, quantize) before that.
        Tiles decoding at once on several lanes each replay their own graph.
        """
        eager = self.model.decode_latents
        if self.vae_graphs is None:
            return eager
        lanes = self.vae_lanes
        return lambda z: self.vae_graphs.run(((tuple(z.shape), lanes.current), ()), z, eager, lambda: ())
