"""Typed specs and result objects exchanged through the platform contract.

Every op-level hook takes one frozen spec and returns one object; new fields
are additive (with defaults) so platform packages keep working across
versions. Tensor names carry shape suffixes:

    T = packed query tokens, S = packed key tokens, N = heads, K = kv heads,
    H = head dim, I = in features, O = out features, E = experts,
    P = KV pages, G = tokens per page, B = sequences in a varlen batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

Reject = Callable[[str], None]
"""Callback a plugin calls with a human-readable reason when it declines."""

QUANT_SCHEMES = ("none", "fp8_tensor", "fp8_row", "mxfp8", "nvfp4", "w8a8")
# How the memory-bound steps around the GEMMs run (``kernels.memory_bound``): auto = Triton where the platform
# has it, else torch ops; triton = demanded (a platform without it refuses); torch = plain torch ops.
MEMORY_BOUND = ("auto", "triton", "torch")
# Which kernel runs the fp8 grouped (expert) GEMMs (``kernels.grouped_fp8``): auto = the platform's fastest one it
# can get (on CUDA sm90 our CUTLASS build where nvcc and the CUTLASS headers are found, else torch's); torch =
# the stock torch kernel; cutlass = the CUTLASS build demanded (a platform without it refuses).
GROUPED_FP8 = ("auto", "torch", "cutlass", "deepgemm")
# ``kernels.grouped_fp8_small_rows``: a platform with a smaller-tile build of its grouped kernel runs it when the
# mean rows per expert group are at most this (0: never). The H200's crossover (BENCHMARKS.md "Sixteenth session").
GROUPED_SMALL_ROWS = 32
# ``kernels.grouped_fp8_skinny_rows``: a fused MoE whose platform has a grouped kernel for a decode step's few rows
# per expert runs it in both expert GEMMs while no expert can get more rows than this: a step of at most this many
# tokens, since a token's experts are distinct (0: never). The H200's crossover (BENCHMARKS.md "Seventeenth
# session").
GROUPED_SKINNY_ROWS = 16
# ``kernels.fp8_skinny_rows``: dense fp8_row GEMMs of at most this many rows (a decode step's) may run a platform's
# kernel for few rows (0: never). The H200's measurement (BENCHMARKS.md "Sixteenth session").
SKINNY_ROWS = 64
# ``kernels.pdl_rows``: a platform's own kernels called on at most this many rows may launch with programmatic
# dependent launch (the launch does not wait for the kernel before; the kernel waits on the device; 0: never).
# Off unless a recipe sets it: the H200's measurement is per recipe (BENCHMARKS.md "Eighteenth session").
PDL_ROWS = 0


# ----------------------------------------------------------------- detection


@dataclass(frozen=True, kw_only=True, slots=True)
class PlatformInfo:
    """What a platform says about itself after cheap detection (no device context)."""

    name: str  # "cuda", "npu", ... ("cpu" for the reference)
    device_type: str  # torch device type string: "cuda", "npu", "xpu", "musa", "cpu"
    dist_backend: str  # torch.distributed backend: nccl, hccl, xccl, mccl, gloo
    device_count: int = 0
    device_name: str = ""
    memory_bytes: int = 0  # per device, 0 when unknown without a device context
    # e.g. {"fp8", "graphs", "paged_kv"}; "channels_last": convolutions run fastest on NHWC activations, so a
    # model may keep its conv weights in torch.channels_last (the CPU reference leaves it out: goldens are NCHW)
    capabilities: frozenset[str] = frozenset()
    accelerator: bool = True  # False only for the CPU reference


# ----------------------------------------------------------------- attention


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionSpec:
    """One attention configuration a model needs; resolved once per distinct spec."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    mask: str = "none"  # "none" (full), "causal" (bottom-right aligned), "dense" (bool mask in meta)
    paged: bool = False  # keys/values come from a paged pool through a block table
    page_size: int = 0  # tokens per page when paged
    backend: str = "auto"  # preference from the recipe: auto|sdpa|varlen|fa3|flex|...
    capturable: bool = False  # the callable will be recorded into a device graph
    scale: float | None = None  # None = 1/sqrt(head_dim)
    # Also return the log-sum-exp of the scaled scores: the callable returns (o_TNH, lse_TN fp32), and
    # -inf where a query sees no key (its o is 0). Ring attention merges partial results with it. A
    # platform whose kernel cannot produce it must refuse the spec (the reference implements it).
    return_lse: bool = False
    # Q, K and V quantized to e4m3 for the two products (``omni.quant.quantize_fp8`` per tensor, dynamic:
    # one scale each for the queries, the keys and the values of the call); output in ``dtype``.
    fp8: bool = False
    memory_bound: str = "auto"  # one of MEMORY_BOUND: how an ``fp8`` spec's q, k and v are quantized

    def __post_init__(self) -> None:
        _check_memory_bound("AttentionSpec", self.memory_bound)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.mask not in ("none", "causal", "dense"):
            raise ValueError(f"AttentionSpec.mask must be none|causal|dense, got {self.mask!r}")
        if self.paged and self.page_size <= 0:
            raise ValueError("AttentionSpec.paged needs page_size > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class VarlenMeta:
    """Packing metadata of one attention call, built once per step by the engine.

    ``cu_seqlens_q_B1`` / ``cu_seqlens_k_B1``: int32 cumulative offsets on the
    device, starting at 0 (CUDA convention). ``*_host``: the same as Python
    tuples (Ascend wants host lists without the leading 0; derive from these).
    Paged: ``block_table_BP`` (int32, pages of each sequence in order) and
    ``seqused_k_B`` (int32 key lengths); k/v passed to the kernel are the pools
    ``[P, G, K, H]``. Dense mask: ``mask_TS`` bool, True = may attend.
    """

    cu_seqlens_q_B1: torch.Tensor
    cu_seqlens_k_B1: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q_host: tuple[int, ...]
    cu_seqlens_k_host: tuple[int, ...]
    block_table_BP: torch.Tensor | None = None
    seqused_k_B: torch.Tensor | None = None
    mask_TS: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q_host) - 1


class AttentionImpl(Protocol):
    """``(q_TNH, k, v, meta) -> o_TNH``; k/v are ``[S, K, H]`` or pools ``[P, G, K, H]``.

    With ``spec.return_lse`` the result is ``(o_TNH, lse_TN)`` and the object
    has ``returns_lse = True`` (core checks it before relying on the LSE).
    """

    name: str

    def __call__(self, q_TNH: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMeta) -> torch.Tensor: ...


def _check_grouped_fp8(spec: str, value: str) -> None:
    if value not in GROUPED_FP8:
        raise ValueError(f"{spec}.grouped_fp8 (kernels.grouped_fp8) must be one of {GROUPED_FP8}, got {value!r}")


def _check_rows(spec: str, field: str, key: str, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"{spec}.{field} ({key}) must be an integer >= 0, got {value!r}")


def _check_memory_bound(spec: str, value: str) -> None:
    if value not in MEMORY_BOUND:
        raise ValueError(f"{spec}.memory_bound (kernels.memory_bound) must be one of {MEMORY_BOUND}, got {value!r}")


# ----------------------------------------------------------------- GEMM


@dataclass(frozen=True, kw_only=True, slots=True)
class GemmSpec:
    """A dense linear ``y = x @ W.T (+ b)`` with W ``[O, I]``."""

    in_features: int
    out_features: int
    dtype: torch.dtype  # activation/output dtype
    quant: str = "none"  # one of QUANT_SCHEMES
    bias: bool = False
    memory_bound: str = "auto"  # one of MEMORY_BOUND: the activation quantization of fp8 schemes
    fast_accum: bool = False  # fp8 products may accumulate without promotion (``kernels.fp8_fast_accum``)
    skinny_rows: int = SKINNY_ROWS  # at most this many rows may take a few-row kernel (``kernels.fp8_skinny_rows``)
    pdl_rows: int = PDL_ROWS  # calls of at most this many rows may launch with PDL (``kernels.pdl_rows``)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"GemmSpec.quant must be one of {QUANT_SCHEMES}, got {self.quant!r}")
        _check_memory_bound("GemmSpec", self.memory_bound)
        _check_rows("GemmSpec", "skinny_rows", "kernels.fp8_skinny_rows", self.skinny_rows)
        _check_rows("GemmSpec", "pdl_rows", "kernels.pdl_rows", self.pdl_rows)


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupedGemmSpec:
    """Per-expert GEMMs over tokens sorted by expert: ``y[t] = x[t] @ W[e(t)].T``."""

    num_experts: int
    in_features: int
    out_features: int
    dtype: torch.dtype
    quant: str = "none"
    fast_accum: bool = False  # fp8 products may accumulate without promotion (``kernels.fp8_fast_accum``)
    grouped_fp8: str = "auto"  # one of GROUPED_FP8: which kernel runs fp8 schemes (``kernels.grouped_fp8``)
    small_rows: int = GROUPED_SMALL_ROWS  # mean rows per expert for a smaller tile (``kernels.grouped_fp8_small_rows``)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"GroupedGemmSpec.quant must be one of {QUANT_SCHEMES}, got {self.quant!r}")
        _check_grouped_fp8("GroupedGemmSpec", self.grouped_fp8)
        _check_rows("GroupedGemmSpec", "small_rows", "kernels.grouped_fp8_small_rows", self.small_rows)


@dataclass(slots=True)
class PreparedWeight:
    """A weight in the layout its kernel wants; ``scale`` is None when unquantized.

    ``data`` is ``[O, I]`` (dense) or ``[E, O, I]`` (grouped) unless the kernel
    documents another layout; ``scale`` is fp32, ``[]`` per tensor or ``[O, 1]``
    / ``[E, O, 1]`` per output row.
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None


class LinearImpl(Protocol):
    name: str

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight: ...

    def __call__(self, x_TI: torch.Tensor, w: PreparedWeight, bias_O: torch.Tensor | None) -> torch.Tensor: ...


class GroupedGemmImpl(Protocol):
    """``(x_TI sorted by expert, w, offsets_E) -> y_TO``; ``offsets_E`` int32 cumulative ends."""

    name: str

    def prepare_weight(self, w_EOI: torch.Tensor) -> PreparedWeight: ...

    def __call__(self, x_TI: torch.Tensor, w: PreparedWeight, offsets_E: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class RowQuantized:
    """Activation rows already quantized for an ``fp8_row`` linear: e4m3 ``q_TI`` and fp32 ``scale_T1``.

    Exactly what ``omni.quant.quantize_fp8(x_TI, per_row=True)`` gives for the
    rows ``x_TI`` (kept beside them after a norm: a consumer that needs the rows
    themselves, the router, reads ``x_TI``). A fused glue kernel (``omni_glue_impl``) hands
    these to a linear whose ``accepts_row_quantized`` is true, which then
    skips its own activation quantization.
    """

    q_TI: torch.Tensor
    scale_T1: torch.Tensor
    x_TI: torch.Tensor | None = None  # None where the producer did not keep them (nothing reads them)


# ----------------------------------------------------------------- glue between the GEMMs


@dataclass(frozen=True, kw_only=True, slots=True)
class GlueSpec:
    """The memory-bound steps of one decoder layer between its GEMMs (see ``omni_glue_impl``).

    RMSNorm over ``hidden`` (and over ``head_dim`` for the QK-norm) with ``eps``,
    the residual add before it, RoPE, the shared expert's SwiGLU and the
    router's softmax / top-``topk``; activations in ``dtype``. ``always_on``: experts every token visits after
    its top-``topk`` (the shared expert run as the routed experts' last group, ``kernels.fuse_shared_expert``):
    the router appends ids ``E .. E + always_on - 1`` with weight 1 to each row.
    """

    hidden: int
    head_dim: int
    eps: float
    dtype: torch.dtype
    topk: int = 1
    memory_bound: str = "auto"  # one of MEMORY_BOUND
    capturable: bool = False
    pdl_rows: int = PDL_ROWS  # calls of at most this many rows may launch with PDL (``kernels.pdl_rows``)
    always_on: int = 0  # ids appended after the top-k by ``route`` (weight 1): the fused shared expert

    def __post_init__(self) -> None:
        _check_memory_bound("GlueSpec", self.memory_bound)
        if self.always_on < 0:
            raise ValueError(f"GlueSpec.always_on must be >= 0, got {self.always_on}")
        _check_rows("GlueSpec", "pdl_rows", "kernels.pdl_rows", self.pdl_rows)
        if self.head_dim % 2:
            raise ValueError(f"GlueSpec.head_dim must be even (rotate-half RoPE), got {self.head_dim}")


class GlueImpl(Protocol):
    """The fused glue of ``omni_glue_impl`` (every method capturable where the platform captures); a glue may
    also have ``store_gather_kv`` (the KV pool's one-pass store + gather), ``group_norm`` (the image paths'
    one-pass GroupNorm [+ FiLM] + SiLU) and ``conv3x3`` / ``conv3x3_weights`` (the image heads' 3x3
    convolutions), all documented there."""

    name: str

    def rms_norm(self, x_TD: torch.Tensor, w_D: torch.Tensor, quantize: bool) -> torch.Tensor | RowQuantized: ...

    def add_rms_norm(self, x_TD: torch.Tensor, d_TD: torch.Tensor, w_D: torch.Tensor,
                     quantize: bool) -> tuple[torch.Tensor, torch.Tensor | RowQuantized]: ...

    def rope_qk_norm(self, qkv_TO: torch.Tensor, cos_TH: torch.Tensor, sin_TH: torch.Tensor, wq_H: torch.Tensor,
                     wk_H: torch.Tensor, heads_NK: tuple[int, int]) -> tuple[torch.Tensor, ...]: ...

    def swiglu(self, h_T2I: torch.Tensor, quantize: bool) -> torch.Tensor | RowQuantized: ...

    def route(self, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# ----------------------------------------------------------------- fused MoE


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """The routed experts of one MoE layer: ``y[t] = sum_j w[t,j] * down_e(x1 * silu(x2))``, ``e = ids[t,j]``.

    ``[x1, x2] = x[t] @ w13[e].T`` splits the ``2 * inner`` outputs in halves; SiLU gates with the
    SECOND half (HunyuanImage-3 order). Router and shared expert stay in the model.
    ``renormalize`` records whether the router renormalised the top-k weights (the impl applies
    the weights as given). ``topk`` is the k of the ids the impl is fed: the router's k (plus the
    always-on experts of a fused shared expert), or 1 where expert parallelism hands each rank
    single routed rows (``omni.parallel.ep``); an impl must also accept fewer columns.
    """

    num_experts: int
    topk: int
    hidden: int  # D: the layer's width (x and y)
    inner: int  # I: each expert's SwiGLU width (w13 is [E, 2I, D], w2 is [E, D, I])
    dtype: torch.dtype  # activation / output dtype
    quant: str = "none"  # one of QUANT_SCHEMES, for both expert GEMMs
    renormalize: bool = True
    memory_bound: str = "auto"  # one of MEMORY_BOUND: gather (+ quantize), SwiGLU (+ quantize), combine
    capturable: bool = False  # the layer runs inside a captured denoising step (graph.mode: capture)
    fast_accum: bool = False  # fp8 expert products may accumulate without promotion (``kernels.fp8_fast_accum``)
    grouped_fp8: str = "auto"  # one of GROUPED_FP8: the kernel of both fp8 expert GEMMs (``kernels.grouped_fp8``)
    small_rows: int = GROUPED_SMALL_ROWS  # as GroupedGemmSpec.small_rows, for both expert GEMMs
    # most rows of one expert, few-row kernel (``kernels.grouped_fp8_skinny_rows``)
    skinny_rows: int = GROUPED_SKINNY_ROWS
    pdl_rows: int = PDL_ROWS  # calls of at most this many rows may launch with PDL (``kernels.pdl_rows``)

    def __post_init__(self) -> None:
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"MoESpec.quant must be one of {QUANT_SCHEMES}, got {self.quant!r}")
        _check_memory_bound("MoESpec", self.memory_bound)
        _check_grouped_fp8("MoESpec", self.grouped_fp8)
        _check_rows("MoESpec", "small_rows", "kernels.grouped_fp8_small_rows", self.small_rows)
        _check_rows("MoESpec", "skinny_rows", "kernels.grouped_fp8_skinny_rows", self.skinny_rows)
        _check_rows("MoESpec", "pdl_rows", "kernels.pdl_rows", self.pdl_rows)
        if not 0 < self.topk <= self.num_experts:
            raise ValueError(f"MoESpec.topk must be in 1..{self.num_experts}, got {self.topk}")


@dataclass(slots=True)
class PreparedMoE:
    """Both expert weights in the layout the MoE kernel wants (``PreparedWeight`` each)."""

    w13: PreparedWeight  # [E, 2I, D] (+ scales)
    w2: PreparedWeight  # [E, D, I] (+ scales)


class MoEImpl(Protocol):
    """``prepare_weights(w13_EOI, w2_EOI) -> PreparedMoE``;
    ``(x_TD, topk_weights_Tk, topk_ids_Tk, prepared) -> y_TD``."""

    name: str

    def prepare_weights(self, w13_EOI: torch.Tensor, w2_EOI: torch.Tensor) -> PreparedMoE: ...

    def __call__(self, x_TD: torch.Tensor, topk_weights_Tk: torch.Tensor, topk_ids_Tk: torch.Tensor,
                 prepared: PreparedMoE) -> torch.Tensor: ...


# ----------------------------------------------------------------- collectives and graphs


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveSpec:
    """A process group the mesh built, for platforms with a faster communicator."""

    axis: str  # mesh axis name: dp, cfg, sp, tp, ep
    world_size: int
    device_type: str


@dataclass(frozen=True, kw_only=True, slots=True)
class CaptureSpec:
    """A static-shape region the engine wants recorded and replayed."""

    device_type: str
    name: str  # e.g. "denoise_step[4096x2]"
    pool_id: int = 0  # regions with the same id may share a memory pool
    # the torch.distributed backend whose collectives run inside the region ("nccl": a tensor-parallel
    # all-reduce in the step); "" when the region exchanges nothing (one device, or CFG parallel, whose
    # exchange runs between replays)
    collectives: str = ""


class GraphRunner(Protocol):
    """Captures ``fn`` with static inputs once; ``replay()`` reruns it."""

    def capture(self, fn: Callable[[], object]) -> object: ...

    def replay(self) -> None: ...


# ----------------------------------------------------------------- plan and recipe checks


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanPatch:
    """A change a platform proposes to the resolved plan; the host applies and logs it."""

    changes: dict[str, object] = field(default_factory=dict)  # dotted recipe path -> new value
    reason: str = ""
