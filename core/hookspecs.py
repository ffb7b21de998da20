"""The platform contract: every hook a platform plugin may implement.

A platform is a pluggy plugin registered under the entry-point group
``omni.platforms``. Exactly one platform is active at a time; the reference
plugin (``omni.reference``, the ``cpu`` platform) is always registered after
it with ``trylast=True`` and answers every factory a platform declines, so a
new platform may implement as few hooks as it likes.

Call sequence of one deployment::

    omni_platform_detect          (every installed platform; cheap)
    omni_check_recipe             (active platform + reference; all reasons kept)
    omni_adjust_plan              (all patches, applied in order and logged)
    omni_platform_configure       (once per worker process: device, seeds)
    omni_device_services          (once per worker)
    omni_dist_backend             (once per worker, before init_process_group)
    omni_shared_device_env        (ranks sharing one device only, before init_process_group)
    omni_attention_impl /
    omni_linear_impl /
    omni_grouped_gemm_impl /
    omni_moe_impl /
    omni_glue_impl                (once per distinct spec while the model is built)
    omni_communicator_impl        (once per mesh axis)
    omni_graph_runner_impl        (once per captured region)
    omni_compile_scope            (a server's warm-up, once, when ``serving.compile_first`` asks for it)
    ... requests run: no hook is called per op or per step ...
    omni_platform_shutdown        (once per worker at exit)

Factories are ``firstresult``: the first non-None answer wins. A plugin that
declines calls ``reject(reason)`` and returns None; when nobody answers, the
host raises an error listing every plugin and its reasons. Nothing is ever
replaced by a slower path silently.

The host (``omni.platform_manager.Platform``) makes every call an ordinary
pluggy call, ``pm.hook.<name>(**kwargs)``, factories included, so a plugin
registered on ``Platform.pm`` with ``@hookimpl(wrapper=True)`` (a tracer, a
cache) and ``pm.add_hookcall_monitoring`` see them as any hook. It registers
the platform and the reference through an adapter that binds each one's
``reject`` to its name, which is how a reason stays attributed. Factory
results are resolved once per spec and cached (graph runners excepted), so
no hook runs per op.

A platform whose entry point fails to import is listed by ``omni-run
platforms`` with the import error and is never selected; it breaks no other
platform.

``omni.platform_parts`` types the vendor modules a device platform's plugin
class is written over (``capabilities``, ``attention``, ``gemm``, ``moe``).

Shape suffixes follow ``omni.specs``: T packed queries, S packed keys, N heads,
K kv heads, H head dim, I in features, O out features, E experts, P pages,
G tokens per page, B sequences.
"""
from __future__ import annotations

from contextlib import AbstractContextManager

import pluggy

from .specs import (
    AttentionImpl,
    AttentionSpec,
    CaptureSpec,
    CollectiveSpec,
    GraphRunner,
    GroupedGemmImpl,
    GroupedGemmSpec,
    LinearImpl,
    MoEImpl,
    MoESpec,
    GemmSpec,
    GlueImpl,
    GlueSpec,
    PlanPatch,
    PlatformInfo,
    Reject,
)

PROJECT = "omni"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ============================================================== startup: detection


@hookspec
def omni_platform_detect(reject: Reject) -> PlatformInfo | None:
    """Say whether this platform's device is present, without touching it.

    When called: by ``omni-run platforms`` and by ``--platform auto`` for
    every installed platform, each on its own (the host calls one plugin at a
    time, so the result list has at most one entry).

    Result: a ``PlatformInfo`` when the device and the vendor runtime are
    usable, else None after ``reject("why")`` (e.g. "torch_npu not importable",
    "this torch is not a ROCm build").

    Args: ``reject`` collects the reason shown to the user.

    Rules: must not create a device context, allocate device memory, import
    a vendor module with side effects it cannot undo, or swallow unexpected
    exceptions. ``torch.cuda.device_count()`` style queries are fine.

    Capture safety: not applicable (startup only).
    Default implementation: the reference reports ``cpu`` (accelerator=False).
    Versions: 0.1.
    """


# ============================================================== plan / config


@hookspec
def omni_check_recipe(recipe: object, info: PlatformInfo, reject: Reject) -> None:
    """Refuse a recipe this platform cannot run, with reasons.

    When called: once at startup, after the recipe loaded, for the active
    platform and the reference. Every implementation runs (no firstresult).

    Result: none; call ``reject(reason)`` once per problem, naming the recipe
    field (for example ``"quant.scheme=nvfp4 needs compute capability 10.0"``).
    Any reason makes startup fail with all reasons listed.

    Args: ``recipe`` an ``omni.recipe.Recipe`` (frozen); ``info`` the active
    platform's ``PlatformInfo``.

    Capture safety: not applicable. Default implementation: checks nothing.
    Versions: 0.1.
    """


@hookspec
def omni_adjust_plan(recipe: object, info: PlatformInfo) -> PlanPatch | None:
    """Propose changes to the recipe for this platform (never mutate it).

    When called: once at startup after ``omni_check_recipe``.
    Result: all non-None patches are applied in plugin order with
    ``dataclasses.replace``; the host logs every changed field and reason.
    Args: as ``omni_check_recipe``.
    Capture safety: not applicable. Default implementation: None.
    Versions: 0.1.
    """


# ============================================================== worker startup


@hookspec(firstresult=True)
def omni_platform_configure(info: PlatformInfo, local_rank: int) -> bool | None:
    """Bind this worker process to its device and set process-wide options.

    When called: once per worker process, before any tensor is put on the
    device (the only hook allowed process-wide side effects such as
    ``torch.cuda.set_device`` or matmul precision flags).
    Result: True when handled. Args: ``local_rank`` the device index on this
    host. Capture safety: not applicable.
    Default implementation: nothing to bind on the CPU; returns True.
    Versions: 0.1.
    """


@hookspec(firstresult=True)
def omni_device_services(info: PlatformInfo) -> object | None:
    """Return the ``omni.device.DeviceServices`` object for this worker.

    When called: once per worker after ``omni_platform_configure``, and once
    more by ``Platform.side_stream()`` when a model asks for its side stream.
    Result: first non-None wins; an object with ``device``, ``synchronize()``,
    ``stream(priority=0)`` (a new stream; None where the device has none),
    ``current_stream()``, ``use_stream(stream)`` (a context making it current),
    ``event(enable_timing)``, ``memory_stats() -> dict``,
    ``max_memory_allocated() -> int``, ``reset_peak_memory()``,
    ``pin(tensor) -> tensor``, ``to_host_async(tensor) -> (host tensor, event
    or None)`` (a copy into page-locked memory queued behind the work so far,
    readable once the event has passed: the text decode steps read their
    tokens through it without waiting for the step they launched next),
    ``empty_cache()``, ``limit_memory(bytes) -> fraction`` (``device.memory_limit_gib``)
    and ``expandable_segments() -> str`` (``device.expandable_segments``: the
    caching allocator grows segments in place from the call on; returns what
    was done, for the log). The build calls the last two before any weight is
    on the device. ``Platform.side_stream()`` builds the MoE's side stream
    (``omni.streams``) from it.
    Capture safety: ``synchronize``, ``memory_stats`` and ``to_host_async``
    must not be used inside a captured region; ``limit_memory`` and
    ``expandable_segments`` only before the first capture.
    Default implementation: ``torch.accelerator``-based services, or the CPU
    services (synchronize is a no-op, no streams, memory from the process RSS,
    ``to_host_async`` copies at once and returns no event, no memory cap, no
    allocator to set). ``expandable_segments`` goes through torch's
    accelerator-wide allocator settings (torch >= 2.9) and leaves the allocator
    alone where ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_<DEVICE>_ALLOC_CONF`` names
    ``expandable_segments``; a platform whose allocator does not read torch's
    settings returns services that set its own.
    Versions: 0.4 (``expandable_segments``); 0.3 (``to_host_async``);
    0.2 (``stream(priority)``); 0.1.
    """


@hookspec(firstresult=True)
def omni_dist_backend(info: PlatformInfo) -> str | None:
    """Name the ``torch.distributed`` backend for this device type.

    When called: once per worker before ``init_process_group``.
    Result: ``"nccl"`` (CUDA and ROCm/RCCL), ``"hccl"``, ``"xccl"``,
    ``"mccl"``, ``"gloo"``; first non-None wins.
    Default implementation: ``info.dist_backend`` (gloo for the CPU).
    Versions: 0.1.
    """


@hookspec(firstresult=True)
def omni_shared_device_env(info: PlatformInfo, rank: int, backend: str) -> dict | None:
    """Name the environment a rank sets when several ranks of one job share one device.

    When called: once per worker, before ``init_process_group``, and only
    when the launcher binds more ranks than devices (``launch(devices=N)``
    with fewer devices than ranks: multi-rank tests on a one-device machine).
    Result: first non-None wins; a ``{name: value}`` dict the worker puts in
    its ``os.environ`` (empty: nothing to set). Args: ``rank`` the global rank,
    ``backend`` the ``torch.distributed`` backend about to be initialised.
    Capture safety: not applicable.
    Default implementation: ``{}`` (gloo needs nothing). CUDA and ROCm with
    ``"nccl"`` (``DevicePlatform.host_id_backends``): a distinct
    ``NCCL_HOSTID`` per rank, so NCCL's (and RCCL's) duplicate-device check
    passes and the ranks exchange data over the socket transport on this host
    (correct, slow: for correctness tests, never for speed; run on CUDA only).
    Versions: 0.1.
    """


# ============================================================== build time: kernel factories
# A factory may compile what its callable will launch (the cuda platform's CUTLASS objects, its Triton kernels'
# row classes: TritonKernels.compile_routes, SkinnyFp8 / GroupedSkinnyFp8.compile_rows), so that no request pays
# a JIT compile: a callable whose launches change with a shape should compile each class here, not at its first
# call. Where the variants are too many to compile blind, a callable may compile a launch's siblings at its first
# call (the cuda kernels' PDL classes: pdl_triton.launch), which a server's warm-up then reaches.


@hookspec(firstresult=True)
def omni_attention_impl(spec: AttentionSpec, reject: Reject) -> AttentionImpl | None:
    """Return a callable computing scaled dot-product attention for ``spec``.

    When called: once per distinct ``spec`` while a model is built; never
    inside ``forward`` or graph capture.

    Result: first non-None wins. The callable is
    ``impl(q_TNH, k, v, meta: VarlenMeta) -> o_TNH`` over packed (varlen)
    sequences. ``q_TNH`` holds ``meta.num_seqs`` query runs split by
    ``meta.cu_seqlens_q_B1``; k/v are ``[S, K, H]`` split by
    ``cu_seqlens_k_B1``, or with ``spec.paged`` the pools ``[P, G, K, H]``
    addressed through ``meta.block_table_BP`` and ``meta.seqused_k_B``.
    Query and key runs may differ in length. ``spec.mask``: ``none`` = every
    query sees every key of its run; ``causal`` = aligned bottom-right
    (query i of a run of Lq sees keys ``j <= i + Lk - Lq``), as FlashAttention;
    ``dense`` = ``meta.mask_TS`` (True = attend) over the packed tokens.
    GQA: N is a multiple of K; query head n uses kv head ``n // (N // K)``.
    Output dtype = q dtype. Scale = ``spec.scale`` or 1/sqrt(H). A query that
    may see no key (causal with Lq > Lk, an all-False dense row) outputs zeros.
    Paged: ``cu_seqlens_k_*`` are the cumulative ``seqused_k``; block-table
    slots past a sequence's last page hold 0 and must not be read.
    ``spec.backend`` other than ``auto`` is a demand: a plugin that is not that
    backend rejects (the reference answers only ``auto`` and ``sdpa``).
    ``spec.fp8`` (``attention.fp8``): q, k and v are quantized to e4m3 with one
    dynamic scale each (``omni.quant.quantize_fp8`` per tensor) for both
    products; the output stays in ``dtype``. ``spec.memory_bound``
    (``kernels.memory_bound``) says how that quantization runs, as for
    ``omni_linear_impl``; a platform with one way of quantizing ignores it.

    Host lengths: an object may set ``reads_host_lengths = False`` when it
    reads sequence lengths only from the device tensors of ``VarlenMeta``
    (``cu_seqlens_*_B1``, ``seqused_k_B``) and takes ``max_seqlen_*`` as upper
    bounds; a captured step may then be replayed for prompts of other lengths
    with padded tables (``omni.step_graphs.step_key``). Without it the host
    lists are assumed read and every prompt length is its own graph.
    Capture safety: with ``spec.capturable`` the callable must not sync the
    host, read tensor values on the host or allocate by tensor values (use the
    ``*_host`` lengths in ``meta``).

    Refusing: ``reject("reason")`` and None (e.g. "fa3: head_dim 320 > 256",
    "paged KV unsupported by sdpa").

    Default implementation: per-sequence ``F.scaled_dot_product_attention``
    in BNSD with explicit masks (the oracle of the conformance suite).
    Versions: 0.2 (``memory_bound``); 0.1.
    """


@hookspec(firstresult=True)
def omni_linear_impl(spec: GemmSpec, reject: Reject) -> LinearImpl | None:
    """Return a dense linear for ``spec`` (quantized or not).

    When called: once per distinct ``spec`` at model build.

    Result: first non-None wins; an object with
    ``prepare_weight(w_OI) -> PreparedWeight`` (called once at load, may
    quantize: fp8_tensor = e4m3 with one fp32 scale, fp8_row = e4m3 with a
    ``[O, 1]`` scale; activations are quantized dynamically per tensor or
    per token) and ``__call__(x_TI, w, bias_O) -> y_TO`` in ``spec.dtype``.
    ``x`` may have leading dims; only the last is I. An ``fp8_row`` linear
    may set ``accepts_row_quantized = True``: its ``__call__`` then also takes
    a ``omni.specs.RowQuantized`` for ``x`` (rows quantized already by a
    fused glue kernel, ``omni_glue_impl``) and uses its e4m3 rows and scales
    as they are; without the attribute the model passes plain rows.

    Kernel choice: ``spec.memory_bound`` (``kernels.memory_bound``) says how
    the memory-bound steps (the activation quantization of fp8 schemes) run:
    ``auto`` Triton where the platform has it, else torch ops; ``torch``
    plain torch ops; ``triton`` demands Triton, so a platform without it
    refuses with a reason naming the field.

    Accumulation: ``spec.fast_accum`` (``kernels.fp8_fast_accum``) permits an
    fp8 product to accumulate in the tensor cores without promoting partial
    sums to fp32 (less exact, faster where the hardware has it); it is a
    permission, not a demand: a platform without such a mode computes as
    without it. Inputs of a lower-precision dtype than ``spec.dtype`` (the
    bf16 rows an fp32 router takes) are taken as exactly that value in
    ``spec.dtype``.

    Few rows: ``spec.skinny_rows`` (``kernels.fp8_skinny_rows``) permits an
    ``fp8_row`` implementation to run calls of at most that many rows (a
    decode step's; read off ``x``'s shape on the host, so a captured call
    keeps its choice) on a kernel made for few rows; the same product summed
    in another order; 0 forbids it. A platform without one ignores it.

    Launch overlap: ``spec.pdl_rows`` (``kernels.pdl_rows``) permits the
    platform's own kernels, on calls of at most that many rows (a shape, read
    on the host: capture safe), to launch with programmatic dependent launch
    (CUDA sm90+): a kernel is set up while the one before it runs and waits on
    the device for its results. The same numbers; 0 forbids it; a platform
    without it ignores it.

    Capture safety: ``__call__`` must be capturable (no host sync).
    Default implementation: ``F.linear``; fp8 schemes quantize to e4m3 and
    compute the dequantized product in fp32 (reference semantics, exact:
    ignores ``fast_accum``, ``skinny_rows`` and ``pdl_rows``); refuses ``memory_bound="triton"``.
    Versions: 0.5 (``pdl_rows``); 0.4 (``skinny_rows``); 0.3 (``fast_accum``; 0.2 ``memory_bound``).
    """


@hookspec(firstresult=True)
def omni_grouped_gemm_impl(spec: GroupedGemmSpec, reject: Reject) -> GroupedGemmImpl | None:
    """Return the grouped (per-expert) GEMM used by MoE layers.

    When called: once per distinct ``spec`` at model build.

    Result: first non-None wins; an object with
    ``prepare_weight(w_EOI) -> PreparedWeight`` and
    ``__call__(x_TI, w, offsets_E) -> y_TO`` where rows of ``x_TI`` are sorted
    by expert and ``offsets_E`` (int32, device) holds cumulative row ends per
    expert (expert e owns rows ``offsets[e-1]:offsets[e]``, empty groups allowed).

    Prepared scales: ``fp8_tensor`` one fp32 scale per expert ``[E, 1, 1]``
    (activations get one scale per expert group), ``fp8_row`` ``[E, O, 1]``
    (activations per token).

    Accumulation: ``spec.fast_accum`` as ``omni_linear_impl`` says.

    Kernel choice: ``spec.grouped_fp8`` (``kernels.grouped_fp8``) names the
    kernel of quantized schemes: ``auto`` the platform's fastest one it can
    get, ``torch`` its stock kernel, ``cutlass`` a CUTLASS build demanded (a
    platform without one refuses with a reason naming the field; the cuda
    platform compiles it once per machine with nvcc). Every choice computes
    the same function; schemes without quantization ignore the field.
    ``spec.small_rows`` (``kernels.grouped_fp8_small_rows``) permits a
    smaller-tile build of that kernel where at most that many rows reach
    each expert on average (rows / E, from the shapes on the host: capture
    safe); the same bits where the tiles differ only in rows (the cuda
    platform's 64- and 128-row builds); 0 forbids it.

    Capture safety: must not read ``offsets_E`` on the host when the MoE runs
    in a captured region (the reference does, so it is never captured).
    Default implementation: a loop over experts with ``F.linear`` (exact);
    refuses any ``grouped_fp8`` but ``auto`` and ``torch`` for quantized schemes.
    Versions: 0.4 (``small_rows``); 0.3 (``grouped_fp8``; 0.2 ``fast_accum``).
    """


@hookspec(firstresult=True)
def omni_moe_impl(spec: MoESpec, reject: Reject) -> MoEImpl | None:
    """Return the routed experts of a MoE layer as one fused operation.

    When called: once per distinct ``spec`` at model build (again at finalize
    when a parallel plan changed the local expert count or width).

    Result: first non-None wins; an object with
    ``prepare_weights(w13_EOI, w2_EOI) -> PreparedMoE`` (called once at load,
    may quantize; ``w13`` is ``[E, 2I, D]``, ``w2`` is ``[E, D, I]``; fp8
    schemes keep the grouped-GEMM scale layouts: ``fp8_row`` ``[E, O, 1]``,
    ``fp8_tensor`` ``[E, 1, 1]`` or broadcast to rows) and
    ``__call__(x_TD, topk_weights_Tk, topk_ids_Tk, prepared) -> y_TD`` in
    ``spec.dtype``: ``y[t] = sum_j w[t, j] * (a @ w2[e].T)`` with
    ``e = ids[t, j]``, ``[x1, x2] = x[t] @ w13[e].T`` split in halves and
    ``a = x1 * silu(x2)`` (SiLU on the SECOND half). Activations are quantized
    dynamically as ``omni_grouped_gemm_impl`` says (per token for ``fp8_row``,
    per expert group for ``fp8_tensor``). ``topk_ids_Tk`` are int64 local
    expert ids in ``[0, E)``; ``k`` is ``spec.topk`` (1 where expert
    parallelism passes single routed rows) or fewer. Routing weights are applied as
    given (``spec.renormalize`` only records what the router did); the
    weighted sum is accumulated in fp32.

    Kernel choice: ``spec.memory_bound`` (``kernels.memory_bound``) says how
    the memory-bound steps (gather and quantize, SwiGLU, combine) run, as
    ``omni_linear_impl`` says: ``auto``, ``torch``, or a ``triton`` demand
    that a platform without Triton refuses with a reason naming the field.
    ``spec.fast_accum`` permits fast accumulation in both expert GEMMs, as
    ``omni_linear_impl`` says; ``spec.grouped_fp8`` picks their kernel and
    ``spec.small_rows`` permits its small-tile build, as
    ``omni_grouped_gemm_impl`` says. ``spec.skinny_rows``
    (``kernels.grouped_fp8_skinny_rows``) permits, where no expert can get
    more rows than that (a call of at most that many tokens: a token's k
    experts are distinct; a shape, read on the host: capture safe), a kernel
    made for a decode step's few rows in both expert GEMMs: the same product,
    possibly summed in another order (the cuda platform's Triton grouped
    kernel, with ``fp8_row`` and fast accumulation); 0 forbids it.
    ``spec.pdl_rows`` permits launch overlap on calls of at most that many
    rows (tokens for the per-token kernels, routed rows for the rest), as
    ``omni_linear_impl`` says.
    An ``fp8_row`` implementation may set
    ``accepts_row_quantized = True``: ``__call__`` then also takes an
    ``omni.specs.RowQuantized`` for ``x_TD`` (the normed rows the fused glue
    quantized for the shared expert) and gathers its e4m3 rows and scales as
    they are instead of quantizing the gathered rows again (the same
    numbers: per-token scales commute with the gather); without the
    attribute the model passes plain rows.
    An implementation may set ``accepts_addends = True``: ``__call__`` then
    also takes ``addends=(a_TD, ...)`` (at most two ``[T, D]`` tensors) and
    returns ``sum(addends) + y`` computed in fp32, the addends first and in
    order, rounded once (``omni.moe.add_terms``), so the model's residual and
    shared-expert adds cost no pass of their own. The model passes none where
    a parallel-plan hook sits on the experts (an expert dispatch must see the
    routed rows' own output), and the residual only where none sits on the
    MLP (its all-reduce must see the MLP's own output); without the attribute
    it adds them itself in the official bf16 order. ``addends`` may also be a
    zero-argument callable returning that tuple: the implementation calls it
    once, right before the first op that reads the addends, and not before
    its last op that does not (the model's shared expert runs on a side
    stream, ``omni.streams``, and the callable joins it there).

    Capture safety: ``__call__`` must not read routing on the host (no
    ``.tolist()``, no ``bincount`` without a fixed size, no shape that depends
    on values) on a platform that advertises ``graphs``; with
    ``spec.capturable`` (the recipe captures the denoising step) an
    implementation that cannot be recorded must refuse, so the build fails
    with the reason instead of the first captured step.
    Refusing: ``reject("reason")`` and None (unsupported dtype or scheme).
    Default implementation: sort routed rows by expert, loop over experts with
    ``omni.quant``'s reference products, combine in fp32 (the oracle; reads
    counts on the host, so it refuses ``capturable`` specs; refuses ``memory_bound="triton"``
    and, for quantized schemes, any ``grouped_fp8`` but ``auto`` and ``torch``).
    A platform may name a kernel that serves this hook only (the cuda
    platform's ``deepgemm``: DeepGEMM's grouped kernel with its own weight
    scales, one per 128x128 block, and exact accumulation; a different
    rounding of the same product, gated in docs/quality.md); its
    ``omni_grouped_gemm_impl`` then resolves that name as ``auto`` (the
    model's ``GroupedLinear`` weight holders resolve one whatever the MoE
    runs).
    Device platforms without a fused kernel get ``omni.moe.ComposedMoE`` over
    their grouped GEMM.
    Versions: 0.11 (``grouped_fp8="deepgemm"``); 0.10 (``pdl_rows``); 0.9 (``skinny_rows``); 0.8 (``small_rows``); 0.7 (``addends`` as a callable);
    0.6 (``accepts_addends``); 0.5 (``grouped_fp8``, ``accepts_row_quantized``; 0.4 ``fast_accum``;
    0.3 ``memory_bound``).
    """


@hookspec(firstresult=True)
def omni_glue_impl(spec: GlueSpec, reject: Reject) -> GlueImpl | None:
    """Return the fused memory-bound steps ("glue") between one decoder layer's GEMMs.

    When called: once per distinct ``spec`` at model build (one per layer
    shape; layers of equal shape share the cached object).

    Result: first non-None wins; an object with these methods (``w_*`` are
    the norm weights in ``spec.dtype``; ``quantize=True`` asks for a
    ``RowQuantized`` of the result: e4m3 rows with per-row fp32 scales exactly
    as ``omni.quant.quantize_fp8(y, per_row=True)``, plus ``y`` itself):

    - ``rms_norm(x_TD, w_D, quantize) -> y_TD | RowQuantized``:
      ``w * round(x * rsqrt(mean(x^2) + eps))``, the mean over the last dim in
      fp32, rounded to ``x.dtype`` before the weight multiplies (the official
      double rounding), ``eps = spec.eps``.
    - ``add_rms_norm(x_TD, d_TD, w_D, quantize) -> (h_TD, y)``: ``h = x + d``
      (the residual add, in ``x.dtype``) and ``rms_norm(h)``.
    - ``rope_qk_norm(qkv_TO, cos_TH, sin_TH, wq_H, wk_H, (N, K)) -> (q_TNH, k_TKH, v_TKH)``:
      splits the packed ``qkv_proj`` output (per KV group g: query heads
      ``g*N/K .. (g+1)*N/K - 1``, then k head g, then v head g), rotates q and
      k with rotate-half RoPE (fp32 ``[T, H]`` tables, computed in fp32,
      rounded), then RMSNorms each head over ``H`` with ``wq`` / ``wk``; ``v``
      untouched (a view is fine).
    - ``swiglu(h_T2I, quantize) -> a_TI | RowQuantized``: ``x1 * silu(x2)``
      with ``[x1, x2]`` the halves of ``h`` (SiLU on the SECOND half).
    - ``route(logits_TE) -> (weights_Tk fp32, ids_Tk int64)``: softmax over
      ``E`` in fp32, the ``spec.topk`` largest (descending), renormalised to
      sum 1; then ``spec.always_on`` more columns, ids ``E, E + 1, ...`` with
      weight 1 each (the shared expert as the routed experts' last group:
      ``k = topk + always_on``; ``omni.reference_glue.append_always_on``).
    - optional, ``store_gather_kv(k_pool_PKH, v_pool_PKH, k_TKH, v_TKH, write_T,
      gather_S, fresh_S) -> (k_SKH, v_SKH)``: a forward's K/V stored in one
      layer's flat pool (``[slots, K, H]``, modified in place) at the int64
      slots ``write_T``, then the key table ``pool[gather_S]`` returned, as
      ``omni.kv_pool.store_gather_kv`` does with two torch ops each;
      bit-exact (copies only). ``fresh_S[s]`` is the row of ``k_TKH`` stored
      at slot ``gather_S[s]`` in this call, or -1 (``omni.kv_pool.fresh_rows``),
      so a one-pass kernel reads those keys from the new rows, never a slot
      it is writing. The model hands it to the KV pool
      (``KVPool.store_gather``), which calls it for gathered key tables;
      without it (the reference glue has none) the pool runs the two torch
      ops and computes no ``fresh_S``.
    - optional, ``group_norm(x, num_groups, weight, bias, eps, *, norm_dtype,
      out_dtype, silu=False, scale_BC=None, shift_BC=None) -> y``: exactly
      ``omni.group_norm.group_norm_act``: GroupNorm of ``x`` ``[B, C, *]``
      (contiguous or channels-last; ``y`` keeps the layout) with fp32
      statistics, rounded to ``norm_dtype``, then FiLM ``y * (1 + scale) +
      shift`` (``[B, C]``) and SiLU, each rounded to ``norm_dtype`` as the
      torch ops round, then ``out_dtype``. The image heads (bf16 chain with
      FiLM) and the VAE ("GroupNorm, swish": fp32 math, rounded once to the
      next convolution's autocast dtype) take it at build
      (``omni.group_norm.use_group_norm_kernel``); without it (the reference
      glue has none) they keep their torch ops.
    - optional pair, ``conv3x3_weights(w_OI33) -> prepared | None`` and
      ``conv3x3(x_BCHW, prepared, bias_O, addend_BOHW=None) -> y_BOHW``: a
      3x3, stride 1, padding 1 convolution ``addend + conv2d(x, w, bias)``.
      ``conv3x3_weights`` runs once per convolution at ``finalize()``
      (``omni.winograd.use_conv3x3_kernel``) and returns the weights the
      kernel reads (a tensor the module keeps as a buffer; the 3x3 weight is
      then released) or None to keep torch's convolution for that shape. The
      result agrees with ``omni.winograd.conv3x3_winograd`` (F(2x2, 3x3),
      products accumulated in fp32, one rounding, then the addend in x's
      dtype) within fp32 summation order; any layout of ``x`` / ``addend``,
      ``y`` channels-last. The image heads take it; without it (the
      reference glue has none) their convolutions are torch's.

    ``T`` may be 0 (a sequence-parallel rank with no tokens). Results match
    the reference within the activation dtype's rounding (a fused kernel
    that keeps fp32 between steps rounds once where the reference rounds
    twice); ties in ``route`` may pick either expert.

    Kernel choice: ``spec.memory_bound`` as ``omni_linear_impl`` says
    (``triton`` demands Triton; a platform without it refuses naming the field);
    ``spec.pdl_rows`` permits launch overlap on calls of at most that many
    rows (tokens; the key table's and new rows for ``store_gather_kv``), as
    ``omni_linear_impl`` says.
    Capture safety: no host sync, no value-dependent shapes.
    Default implementation: ``omni.reference_glue.ReferenceGlue``, plain torch
    ops that run on any device (the fallback of every platform without fused
    glue; it refuses ``memory_bound="triton"``).
    Versions: 0.6 (``conv3x3``); 0.5 (``always_on``); 0.4 (``pdl_rows``); 0.3 (``group_norm``);
    0.2 (``store_gather_kv``).
    """


@hookspec(firstresult=True)
def omni_communicator_impl(spec: CollectiveSpec, group: object, reject: Reject) -> object | None:
    """Optionally return a faster communicator for one mesh axis.

    When called: once per mesh axis after the process groups exist.
    Result: an object with ``all_reduce(t)``, ``all_gather(t, dim)`` and
    ``all_to_all(t, splits_in, splits_out)``; None means core uses plain
    ``torch.distributed`` on ``group``.
    Capture safety: returned ops must be capturable when the platform
    advertises the ``graphs`` capability.
    Default implementation: None (torch.distributed).
    Versions: 0.1.
    """


@hookspec(firstresult=True)
def omni_graph_runner_impl(spec: CaptureSpec, reject: Reject) -> GraphRunner | None:
    """Return a graph capture/replay runner, or None to run eagerly.

    When called: once per static-shape region (one per shape bucket) when the
    recipe enables ``graph.mode: capture``.
    Result: first non-None wins; ``runner.capture(fn)`` records ``fn()`` once
    (after warm-up done by the runner) and returns its static outputs;
    ``runner.replay()`` reruns the recorded work on the same buffers.
    ``spec.collectives``: the ``torch.distributed`` backend whose collectives
    ``fn`` issues (a tensor-parallel all-reduce; "" for none). A platform
    rejects a backend it cannot record (gloo blocks the host; the CUDA
    platform records NCCL); every rank captures the same regions in the same
    order, so the recorded collectives pair up on replay.
    Default implementation: rejects ("the reference platform runs eagerly");
    a recipe that asks for capture on such a platform fails at startup.
    Versions: 0.2 (``spec.collectives``).
    """


# ============================================================== warm-up


@hookspec(firstresult=True)
def omni_compile_scope(info: PlatformInfo) -> AbstractContextManager | None:
    """Return a context manager inside which the platform's just-in-time kernels are compiled, not run.

    When called: once per worker, by a server's warm-up under ``serving.compile_first``
    (``omni.compile_pass``): the warm-up requests run once inside the scope (the compile pass), then once for
    real. On a multi-rank replica every rank enters it around the same calls.
    Result: first non-None wins; None means this platform compiles nothing at first launch worth gathering
    (no compile pass runs). Inside the scope a kernel launch that would compile first hands the compile to the
    platform's pool and returns without running, so one pass meets every kernel signature the warm-up
    launches and the compiles run together; leaving the scope waits for them (and raises the first compile
    error). Outputs of kernels that did not run are undefined; the platform must keep every output that
    later ops index with defined inside the scope (the cuda platform computes the router's choices and the
    expert sort with the reference's torch ops there), and may run ops that need no compile for real.
    Nothing is captured inside it (``StepGraphs`` runs eagerly during the pass).
    Capture safety: never entered while capturing.
    Default implementation: none (the reference runs torch ops, which compile nothing).
    Versions: 0.1.
    """


# ============================================================== teardown


@hookspec
def omni_platform_shutdown(info: PlatformInfo) -> None:
    """Release platform resources (communicators, graph pools) at worker exit.

    When called: once per worker, after the last request, also on errors.
    Result: ignored; every implementation runs.
    Default implementation: nothing.
    Versions: 0.1.
    """
