"""Text-to-image on the prefix-KV engine path (DESIGN.md, "The model").

Per request: build the conditional (and unconditional) rows, run their text
prefix once (causal prefill, K/V kept in the pool), then at every denoising
step run only ``<timestep>`` + image tokens. Within a step each row is two
varlen runs with no mask: the timestep query over ``[prefix; timestep]`` and
the image queries over ``[prefix; timestep; image]`` -- exactly the official
generalized-causal mask, without materialising it. All rows of all active
requests (any resolution, step count, guidance) pack into one forward.

Multi-device: ``parallel`` (an ``omni.parallel.runtime.ParallelRuntime``,
None on one device) says which rows this worker computes (CFG parallel),
runs each packed forward (sequence parallel) and exchanges the rows'
predictions after a step; tensor/expert parallelism live inside the model's
modules. This file never touches torch.distributed itself.

Shape suffixes: T packed tokens, D hidden, C latent channels, h/w token grid,
H head dim (rope tables).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from omni.kv_pool import KVPool, PoolContext, Run
from omni.request import ImageRequest, StageTimes
from omni.step_cache import StepCache, after_step, plan_skips
from omni.step_graphs import step_key

from .rope import rope_cos_sin
from .sampler import cfg_combine, euler_step, flow_match_sigmas
from .sequence import T2ISequence, build_t2i_pair
from omni.vae_tiling import TileLanes, tiled_decode
from .resolution import snap


@dataclass
class Row:
    """One CFG row of a request and the KV pages holding its keys."""

    seq: T2ISequence
    pages: list[int]
    block_rope: tuple | None = None  # (cos_TH, sin_TH) of the step block, built once on the device

    @property
    def block_len(self) -> int:  # <timestep> + image tokens
        return 1 + self.seq.token_h * self.seq.token_w


@dataclass
class RequestState:
    request: ImageRequest
    rows: list[Row]
    latents_1Chw: torch.Tensor  # fp32
    sigmas: torch.Tensor  # [steps + 1] fp32, on the host
    seed: int
    step: int = 0
    times: StageTimes = field(default_factory=StageTimes)
    cache: StepCache = field(default_factory=lambda: StepCache(0.0))
    total_rows: int = 0  # rows of the request on all workers (0: as many as ``rows``)

    @property
    def done(self) -> bool:
        return self.step >= len(self.sigmas) - 1

    @property
    def t(self) -> float:
        return float(self.sigmas[self.step]) * 1000.0


class HunyuanImage3Pipeline:
    """Owns the model, VAE, tokenizer and KV pool of one worker; no scheduling policy."""

    step_graphs = None  # an omni.step_graphs.StepGraphs under graph.mode: capture (set by build_pipeline)
    vae_graphs = None  # the same for VAE decodes, keyed by the latent (tile) shape

    def __init__(self, *, model, vae, tokenizer, config, pool: KVPool, device, paged: bool,
                 vae_dtype: torch.dtype = torch.float32, parallel=None, step_cache: float = 0.0,
                 vae_tiles: tuple[int, int] | None = None, vae_lanes: TileLanes | None = None, offloaders=()):
        self.model, self.vae, self.tok, self.cfg = model, vae, tokenizer, config
        self.parallel, self.step_cache, self.vae_tiles = parallel, step_cache, vae_tiles
        self.vae_lanes = vae_lanes or TileLanes()  # tiles decoded on several streams at once
        self.offloaders = list(offloaders)  # omni.offload.LayerOffloader objects (their hooks do the work)
        self.pool, self.device, self.paged, self.vae_dtype = pool, torch.device(device), paged, vae_dtype
        self.downsample = config.vae_downsample_factor[0] * config.patch_size
        self.latent_channels = vae.cfg.latent_channels

    # ---------------------------------------------------------------- admission
    def build_rows(self, req: ImageRequest) -> list[T2ISequence]:
        _, h_px, w_px = snap(req.height, req.width)
        kw = dict(template=req.template, height=h_px, width=w_px, downsample=self.downsample,
                  system_prompt=req.system_prompt, cot_text=req.cot_text)
        if not req.use_cfg:
            return list(build_t2i_pair(self.tok, req.prompt, cfg=False, **kw))
        if req.negative_prompt is None:
            return list(build_t2i_pair(self.tok, req.prompt, cfg=True, **kw))
        return [build_t2i_pair(self.tok, p, cfg=False, **kw)[0] for p in (req.prompt, req.negative_prompt)]

    def rows_here(self, seqs: list[T2ISequence]) -> list[T2ISequence]:
        """The rows this worker computes: all of them, unless CFG parallel puts rows on other ranks."""
        return seqs if self.parallel is None else [seqs[i] for i in self.parallel.cfg_rows(len(seqs))]

    def pages_needed(self, req: ImageRequest) -> int:
        return sum(self.pool.pages_for(s.prefix_len + 1 + s.token_h * s.token_w)
                   for s in self.rows_here(self.build_rows(req)))

    def admit(self, req: ImageRequest) -> RequestState:
        """Allocate pages for every row (all or nothing) and draw the initial noise."""
        seqs = self.build_rows(req)
        rows: list[Row] = []
        try:
            for s in self.rows_here(seqs):
                rows.append(Row(s, self.pool.allocate(s.prefix_len + 1 + s.token_h * s.token_w)))
        except Exception:
            self.release_rows(rows)
            raise
        seed = req.seed if req.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        cache = StepCache(self.step_cache if req.step_cache is None else req.step_cache)
        return RequestState(req, rows, self._noise(seed, seqs[0]), flow_match_sigmas(req.steps, req.shift), seed,
                            total_rows=len(seqs), cache=cache)

    def _noise(self, seed: int, seq: T2ISequence) -> torch.Tensor:
        """Noise drawn in bf16 on a CPU generator (as the official code), identical for both rows."""
        g = torch.Generator().manual_seed(seed)
        shape = (1, self.latent_channels, seq.token_h, seq.token_w)
        return torch.randn(shape, generator=g, dtype=torch.bfloat16).float().to(self.device)

    def release(self, state: RequestState) -> None:
        self.release_rows(state.rows)
        state.rows = []

    def release_rows(self, rows: list[Row]) -> None:
        for r in rows:
            self.pool.release(r.pages)

    # ---------------------------------------------------------------- forwards
    def _rope(self, pos_yx: list[tuple[int, int]]):
        pos_T2 = torch.tensor(pos_yx, dtype=torch.long, device=self.device)
        cos, sin = rope_cos_sin(pos_T2, self.cfg.head_dim, self.cfg.rope_theta)
        return cos.to(self.model_dtype), sin.to(self.model_dtype)

    @property
    def model_dtype(self) -> torch.dtype:
        return self.model.model.wte.weight.dtype

    @torch.inference_mode()
    def prefill(self, states: list[RequestState]) -> None:
        """Causal forward over every row's text prefix; only its K/V are kept."""
        t0 = time.perf_counter()
        rows = [r for s in states for r in s.rows]
        ids = torch.tensor([i for r in rows for i in r.seq.ids[: r.seq.prefix_len]], device=self.device)
        pos = [p for r in rows for p in r.seq.pos_yx[: r.seq.prefix_len]]
        runs = [Run(tuple(r.pages), 0, r.seq.prefix_len, r.seq.prefix_len) for r in rows]
        self._backbone(self.model.embed_tokens(ids), *self._rope(pos), runs, "causal")
        for s in states:
            s.times.prefill += time.perf_counter() - t0

    @torch.inference_mode()
    def denoise_step(self, states: list[RequestState]) -> None:
        """One Euler step for every state; the rows of all computed requests share one forward."""
        t0 = time.perf_counter()
        blocks = [self._block(s) for s in states]
        edge = [s.step == 0 or s.step == len(s.sigmas) - 2 for s in states]
        skip = plan_skips([s.cache for s in states], [b[0] for b in blocks], edge)
        h_all = self._forward_blocks([b for b, k in zip(blocks, skip) if not k],
                                     step_key([s for s, k in zip(states, skip) if not k]))
        offset, preds = 0, []
        for s, (x_TD, _, _), k in zip(states, blocks, skip):
            h_TD = None if k else h_all[offset: offset + x_TD.shape[0]]
            offset += 0 if k else x_TD.shape[0]
            preds.append(self._velocity(s, after_step(s.cache, x_TD, h_TD)))
        if self.parallel is not None:  # CFG parallel: every rank gets every row's prediction
            preds = self.parallel.exchange_predictions(preds, [s.total_rows or len(s.rows) for s in states])
        for s, v_BChw in zip(states, preds):
            self._update(s, v_BChw)
            s.times.denoise += time.perf_counter() - t0
            s.times.steps_skipped = s.cache.skipped

    def _forward_blocks(self, blocks: list, key: tuple = ()) -> torch.Tensor | None:
        if not blocks:
            return None
        x_TD = torch.cat([b[0] for b in blocks])
        ropes, runs = [t for b in blocks for t in b[1]], [r for b in blocks for r in b[2]]
        cos_TH, sin_TH = torch.cat([c for c, _ in ropes]), torch.cat([s for _, s in ropes])
        if self.step_graphs is not None:  # graph.mode: capture: replay the graph of this batch signature
            return self.step_graphs.run(key, x_TD, self.model.backbone, lambda: (cos_TH, sin_TH, PoolContext(
                self.pool, runs, mask="none", paged=self.paged, device=self.device)))
        return self._backbone(x_TD, cos_TH, sin_TH, runs, "none")

    def _backbone(self, x_TD, cos_TH, sin_TH, runs: list[Run], mask: str) -> torch.Tensor:
        """The decoder over one packed forward whose attention reads and writes the KV pool."""
        if self.parallel is not None:
            return self.parallel.run_backbone(self.model, x_TD, cos_TH, sin_TH, pool=self.pool, runs=runs,
                                              mask=mask, paged=self.paged, device=self.device)
        ctx = PoolContext(self.pool, runs, mask=mask, paged=self.paged, device=self.device)
        return self.model.backbone(x_TD, cos_TH, sin_TH, ctx)

    def _block(self, s: RequestState):
        """This request's packed step input: (x_TD over its rows, per-row rope tables, runs)."""
        t_1 = torch.full((1,), s.t, dtype=torch.float32, device=self.device)
        img_1LD = self.model.image_tokens(s.latents_1Chw.to(self.model_dtype), t_1)
        ts_1D = self.model.timestep_token(t_1).to(self.model_dtype)
        x_parts, ropes, runs = [], [], []
        for r in s.rows:
            p, n = r.seq.prefix_len, r.block_len
            if r.block_rope is None:  # positions never change: build the tables once per request
                r.block_rope = self._rope(r.seq.pos_yx[p: p + n])
            x_parts += [ts_1D, img_1LD[0]]
            ropes.append(r.block_rope)
            runs += [Run(tuple(r.pages), p, p + 1, p + 1), Run(tuple(r.pages), p + 1, p + n, p + n)]
        return torch.cat(x_parts), ropes, runs

    def _velocity(self, s: RequestState, h_TD: torch.Tensor) -> torch.Tensor:
        """The velocity of each of ``s``'s rows here, ``[rows, C, h, w]`` fp32."""
        th, tw = s.rows[0].seq.token_h, s.rows[0].seq.token_w
        h_RnD = h_TD.view(len(s.rows), -1, h_TD.shape[-1])[:, 1:]  # rows share one block length
        t_B = torch.full((len(s.rows),), s.t, dtype=torch.float32, device=self.device)
        return self.model.velocity(h_RnD, t_B, th, tw).float()

    def _update(self, s: RequestState, v_BChw: torch.Tensor) -> None:
        """Guidance (two rows) and one Euler step."""
        v = cfg_combine(v_BChw[:1], v_BChw[1:], s.request.guidance) if v_BChw.shape[0] == 2 else v_BChw
        s.latents_1Chw = euler_step(s.latents_1Chw, v, s.sigmas[s.step], s.sigmas[s.step + 1])
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
        factor = self.vae.cfg.ffactor_spatial
        run = tiled_decode if self.parallel is None else self.parallel.tiled_decode
        return run(decode, z_1Chw, tile=tile, overlap=overlap, factor=factor, lanes=self.vae_lanes)

    def _vae_decoder(self):
        """latents -> pixels; replayed from a graph per latent shape under graph.mode: capture.

        A replay returns the graph's static output, which the next replay
        overwrites: callers consume it (blend a tile, quantize) before that.
        Tiles decoding at once on several lanes each replay their own graph.
        """
        eager = lambda z: self.vae.decode_image(z, dtype=self.vae_dtype)  # noqa: E731
        if self.vae_graphs is None:
            return eager
        lanes = self.vae_lanes
        return lambda z: self.vae_graphs.run(((tuple(z.shape), lanes.current), ()), z, eager, lambda: ())
