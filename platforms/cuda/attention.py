"""Attention kernels of the CUDA platform and the rule that picks one per spec.

May assume: the spec is resolved on a worker whose CUDA device is set; tensors
passed to the returned objects live on that device. Vendor modules (FA3) are
imported here lazily, at resolution, never at package import.

Backends, in ``auto`` order for masks ``none`` / ``causal``:

    fa3     FlashAttention-3 varlen (``fa3_fwd_interface`` or ``flash_attn_interface``):
            sm90, fp16/bf16 (as built), head_dim <= 256, paged through
            ``flash_attn_with_kvcache`` when the build has paged KV.
    varlen  ``torch.nn.attention.varlen.varlen_attn`` (aten FlashAttention-2):
            sm80+, fp16/bf16, head_dim % 8 == 0 and <= 256, paged when this torch
            takes ``block_table``/``seqused_k`` and page_size % 256 == 0.
    sdpa    ``F.scaled_dot_product_attention`` in BNSD (cuDNN / flash / efficient
            chosen by torch; ``omni.platforms.common.sdpa``): any dtype; equal-length batches in one call, else
            one call per sequence; paged pools gathered on the device with
            a length mask (no host sync).

``dense`` masks go to sdpa with the bool mask under ``auto``; ``flex``
(compiled FlexAttention with a block mask) serves every mask when asked for
by name, and is the one backend for specs that ask for the log-sum-exp
(``return_lse``: ring attention's partials). A named backend that cannot serve a spec is refused with its
reason; the chain is only walked for ``auto``. Every object here is
capturable except flex (its block mask is rebuilt from host lengths).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from omni import quant
from omni.platforms.common.attention import first_fit, lengths, softmax_scale
from omni.platforms.common.sdpa import SdpaAttention
from omni.specs import AttentionSpec, VarlenMeta

from .capabilities import Caps, Fa3, load_fa3, log_once, runs_triton, triton_found

HALF = (torch.float16, torch.bfloat16)
BACKENDS = ("fa3", "varlen", "sdpa", "flex")
LSE_BACKENDS = ("flex",)  # the backends that can also return the log-sum-exp (``AttentionSpec.return_lse``)
FP8_BACKENDS = ("fa3",)  # the backends with e4m3 products (``AttentionSpec.fp8``, recipe attention.fp8)


def _cu_from_lengths(lengths_B: torch.Tensor) -> torch.Tensor:
    return F.pad(lengths_B.cumsum(0, dtype=torch.int32), (1, 0))


# ----------------------------------------------------------------- FA3


class Fa3Attention:
    """FA3's forward through the build's registered op (``Fa3.fwd``) where it has one, else its Python wrappers.

    Both routes launch the same kernel with the same arguments: the op gets the
    values the wrappers pass (``num_splits`` 1 for varlen, 0, the heuristic,
    for the paged call), so outputs are bit-identical (tests/gpu/test_gpu_fa3_op.py).
    The wrappers copy a q/k/v whose last dimension is strided; the op refuses
    one, loudly. The model's projections give contiguous heads either way.
    """

    reads_host_lengths = False  # lengths from the device tensors; the host maxima are only upper bounds

    def __init__(self, spec: AttentionSpec, fa3: Fa3, quantize=None):
        route = "" if fa3.fwd is None else ", op"
        self.name = f"cuda-fa3({fa3.name}{', fp8' if spec.fp8 else ''}{route})"
        self.mod, self.fwd, self.paged, self.fp8 = fa3.module, fa3.fwd, spec.paged, spec.fp8
        self.scale, self.causal = softmax_scale(spec), spec.mask == "causal"
        self.quantize = quantize or fp8_per_tensor  # e4m3 per tensor: ``fp8_quantizer``'s choice at build time
        self.run = self._op if fa3.fwd is not None else self._wrapped  # chosen once, not per call
        self.group, self.block_m = spec.num_heads // spec.num_kv_heads, fa3_block_m(spec.head_dim)
        # the wrapper route passes ``pack_gqa`` where the wrapper takes it (older builds' do not)
        self.wrapper_packs = fa3.fwd is None and _takes(getattr(fa3.module, "flash_attn_varlen_func", None),
                                                        "pack_gqa")

    def __call__(self, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        if not self.fp8:
            return self.run(q_TNH, k, v, meta)
        # e4m3 q, k, v with one dynamic scale each (``omni.quant``'s per-tensor rule); bf16 out
        (qq, sq), (kq, sk), (vq, sv) = (self.quantize(t) for t in (q_TNH, k, v))
        shape = (meta.num_seqs, k.shape[-2])  # FA3 takes descales per (sequence, kv head)
        out = self.run(qq, kq, vq, meta, q_descale=sq.expand(shape), k_descale=sk.expand(shape),
                       v_descale=sv.expand(shape))
        return out.to(q_TNH.dtype)

    def _op(self, q_TNH, k, v, meta: VarlenMeta, **descales) -> torch.Tensor:
        """The registered op, with the split count each wrapper passes (1 varlen, 0 paged: the heuristic)."""
        if self.paged:
            lengths = dict(seqused_k=meta.seqused_k_B, page_table=meta.block_table_BP, num_splits=0)
        else:
            lengths = dict(cu_seqlens_k=meta.cu_seqlens_k_B1, max_seqlen_k=meta.max_seqlen_k, num_splits=1,
                           pack_gqa=self.pack_gqa(meta.max_seqlen_q))
        return self.fwd(q_TNH, k, v, cu_seqlens_q=meta.cu_seqlens_q_B1, max_seqlen_q=meta.max_seqlen_q, **lengths,
                        **descales, softmax_scale=self.scale, is_causal=self.causal)[0]

    def _wrapped(self, q_TNH, k, v, meta: VarlenMeta, **descales) -> torch.Tensor:
        kw = {"softmax_scale": self.scale, "causal": self.causal, **descales}
        if self.paged:  # never with descales: fp8 is refused for paged specs (``build_fa3``)
            out = self.mod.flash_attn_with_kvcache(
                q_TNH, k, v, cache_seqlens=meta.seqused_k_B, page_table=meta.block_table_BP,
                cu_seqlens_q=meta.cu_seqlens_q_B1, max_seqlen_q=meta.max_seqlen_q, **kw)
        else:
            if self.wrapper_packs:
                kw["pack_gqa"] = self.pack_gqa(meta.max_seqlen_q)
            out = self.mod.flash_attn_varlen_func(
                q_TNH, k, v, meta.cu_seqlens_q_B1, meta.cu_seqlens_k_B1, meta.max_seqlen_q, meta.max_seqlen_k, **kw)
        return out[0] if isinstance(out, tuple) else out  # older builds return (out, lse)

    def pack_gqa(self, max_seqlen_q: int) -> bool:
        """Whether FA3 packs a KV head's query heads into shared M tiles (``fa3_pack_gqa``) for this call."""
        return fa3_pack_gqa(max_seqlen_q, self.group, self.block_m)


def fa3_block_m(head_dim: int) -> int:
    """The M tile (query rows) of FA3's sm90 forward: 192 for head_dim <= 64, else 128 (its ``tile_size_fwd_sm90``)."""
    return 192 if head_dim <= 64 else 128


def fa3_pack_gqa(max_seqlen_q: int, group: int, block_m: int) -> bool:
    """FA3's own packing rule for fixed-length batches, applied to a varlen call's longest query sequence.

    Why: FA3 packs every varlen call (it knows only the maximum length), and packing costs time where one head's
    rows already fill their tiles: the image step's 2 x 4097 queries (32/8 heads of 128) ran 0.987 ms packed and
    0.821 ms unpacked on an H200, the captured step 1.010x faster (BENCHMARKS.md, "Forty-seventh session"). Its
    fixed-length rule (``should_pack_gqa``) packs only where one head's last tile would be much emptier than the
    packed rows' last tile: decode (1 query) and short prompts still pack, the image step does not.
    """
    if group == 1:
        return False
    fill = lambda rows: rows / (-(-rows // block_m) * block_m)  # noqa: E731  the share of M-tile rows in use
    return fill(max_seqlen_q) < 0.9 * fill(max_seqlen_q * group)


def _takes(fn, keyword: str) -> bool:
    """Whether ``fn`` accepts ``keyword`` (older FA3 wrappers lack ``pack_gqa``)."""
    try:
        return fn is not None and keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the older wrapper
        return False


def fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 ``x``, its fp32 scale ``[1, 1]``): absmax / 448 over the whole tensor, no host read."""
    q, scale = quant.quantize_fp8(x, per_row=False)
    return q, scale.reshape(1, 1)


def fp8_quantizer(spec: AttentionSpec, reject):
    """``attention.fp8``'s per-tensor quantization, chosen by ``spec.memory_bound`` as the MoE's and the linears'
    memory-bound kernels are (``memory_kernels``): two Triton passes (``fp8_tensor_triton``, the reference's bits)
    for ``auto`` where Triton imports and for ``triton``, else ``fp8_per_tensor``'s torch ops. None for bf16 specs,
    and after ``reject`` where ``triton`` is demanded and Triton does not import."""
    if not spec.fp8:
        return None
    use = runs_triton(spec.memory_bound, triton_found(), reject,
                      "fa3: kernels.memory_bound=triton, but triton does not import here (the fp8 quantization)")
    if not use:
        return None if use is None else fp8_per_tensor
    from .fp8_tensor_triton import quantize_fp8_per_tensor

    return quantize_fp8_per_tensor


def build_fa3(spec: AttentionSpec, caps: Caps, reject, load=load_fa3):
    if caps.fa3_module is None:
        return reject("fa3: neither fa3_fwd_interface nor flash_attn_interface is installed")
    if caps.sm[0] != 9:
        return reject(f"fa3: needs sm90 (Hopper), this device is {caps.sm_name}")
    if spec.mask == "dense":
        return reject("fa3: no arbitrary (dense) masks; use sdpa or flex")
    if spec.dtype not in HALF or spec.head_dim > 256:
        return reject(f"fa3: needs fp16/bf16 and head_dim <= 256, got {spec.dtype} / {spec.head_dim}")
    fa3 = load(caps.fa3_module)
    if isinstance(fa3, str):
        return reject(fa3)
    return _fa3_build_fits(spec, fa3, reject)


def _fa3_build_fits(spec: AttentionSpec, fa3: Fa3, reject):
    if spec.dtype == torch.float16 and not fa3.fp16:
        return reject(f"fa3: {fa3.name} was built without fp16 kernels")
    if not any(spec.head_dim <= d for d in fa3.head_dims):
        return reject(f"fa3: {fa3.name} has no kernel for head_dim {spec.head_dim}")
    if spec.paged and not (fa3.paged and hasattr(fa3.module, "flash_attn_with_kvcache")):
        return reject(f"fa3: {fa3.name} was built without paged KV")
    if spec.fp8 and (spec.paged or not fa3.fp8):
        why = "paged KV (gathered keys only)" if spec.paged else f"{fa3.name} was built without fp8 kernels"
        return reject(f"fa3: attention.fp8 is not served with {why}")
    quantize = fp8_quantizer(spec, reject)
    if spec.fp8 and quantize is None:
        return None
    return Fa3Attention(spec, fa3, quantize)


# ----------------------------------------------------------------- torch varlen_attn


class VarlenAttention:
    name = "cuda-varlen"
    reads_host_lengths = False  # as FA3: cu_seqlens / seqused tensors; max_seqlen_* are upper bounds

    def __init__(self, spec: AttentionSpec, params: frozenset[str]):
        from torch.nn.attention.varlen import varlen_attn

        self.fn, self.paged = varlen_attn, spec.paged
        self.kw: dict = {"scale": softmax_scale(spec)} if "scale" in params else {}
        if spec.mask == "causal":  # bottom-right aligned, as FlashAttention
            self.kw.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
        if spec.num_heads != spec.num_kv_heads and "enable_gqa" in params:
            self.kw["enable_gqa"] = True  # older versions pass fewer kv heads straight to the kernel

    def __call__(self, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        if not self.paged:
            return self.fn(q_TNH, k, v, meta.cu_seqlens_q_B1, meta.cu_seqlens_k_B1,
                           meta.max_seqlen_q, meta.max_seqlen_k, **self.kw)
        cu_k = meta.cu_seqlens_k_B1 if meta.cu_seqlens_k_B1 is not None else _cu_from_lengths(meta.seqused_k_B)
        return self.fn(q_TNH, k, v, meta.cu_seqlens_q_B1, cu_k, meta.max_seqlen_q, meta.max_seqlen_k,
                       seqused_k=meta.seqused_k_B, block_table=meta.block_table_BP, **self.kw)


def build_varlen(spec: AttentionSpec, caps: Caps, reject):
    params = caps.varlen_params
    if not params:
        return reject("varlen: torch.nn.attention.varlen.varlen_attn is not in this torch (needs >= 2.10)")
    if caps.sm < (8, 0):
        return reject(f"varlen: FlashAttention-2 needs sm80+, this device is {caps.sm_name}")
    if spec.mask == "dense":
        return reject("varlen: no arbitrary (dense) masks; use sdpa or flex")
    if spec.dtype not in HALF or spec.head_dim % 8 or spec.head_dim > 256:
        return reject(f"varlen: needs fp16/bf16 and head_dim % 8 == 0, <= 256; got {spec.dtype} / {spec.head_dim}")
    if spec.mask == "causal" and not params & {"window_size", "is_causal"}:
        return reject("varlen: this torch's varlen_attn has no causal option")
    if spec.scale is not None and "scale" not in params:
        return reject("varlen: this torch's varlen_attn takes no scale")
    if spec.paged and not caps.native_paged:
        return reject("varlen: this torch's varlen_attn takes no block_table/seqused_k (paged KV)")
    if spec.paged and spec.page_size % 256:
        return reject(f"varlen: FlashAttention-2 paged KV needs page_size % 256 == 0, got {spec.page_size}")
    return VarlenAttention(spec, params)


# ----------------------------------------------------------------- SDPA


def build_sdpa(spec: AttentionSpec, caps: Caps, reject):
    return SdpaAttention(spec, "cuda-sdpa")


# ----------------------------------------------------------------- FlexAttention


class FlexAttention:
    """Compiled FlexAttention over all packed tokens with a document (or dense) block mask."""

    name = "cuda-flex"

    def __init__(self, spec: AttentionSpec):
        from torch.nn.attention import flex_attention as fa

        self.spec, self.scale = spec, softmax_scale(spec)
        self.returns_lse = spec.return_lse  # ring attention merges partials by it (core checks this flag)
        self.lse_kw = {}
        if spec.return_lse:
            self.name = "cuda-flex-lse"
            aux = getattr(fa, "AuxRequest", None)  # return_lse is deprecated where AuxRequest exists
            self.lse_kw = {"return_aux": aux(lse=True)} if aux is not None else {"return_lse": True}
        self.create_block_mask = fa.create_block_mask
        self.flex = torch.compile(fa.flex_attention, dynamic=False)
        # packed prefill, not decode: keep inductor off the flex-decoding kernel, which it picks for
        # queries shorter than 128 and which finds no valid config for GQA-packed dense masks (torch 2.11)
        backend = "BACKEND" in getattr(getattr(fa, "FlexKernelOptions", None), "__annotations__", {})
        self.kernel_options = {"BACKEND": "TRITON"} if backend else {"FORCE_USE_FLEX_ATTENTION": True}

    def __call__(self, q_TNH, k, v, meta: VarlenMeta):
        """``o_TNH``, or ``(o_TNH, lse_TN)`` (natural log, fp32; -inf where a query sees no key) with return_lse."""
        t, s = q_TNH.shape[0], k.shape[0]
        block_mask = self.create_block_mask(self._mask_mod(meta, q_TNH.device), None, None, t, s, device=q_TNH.device)
        q, k, v = (x.transpose(0, 1).contiguous()[None] for x in (q_TNH, k, v))
        out = self.flex(q, k, v, block_mask=block_mask, scale=self.scale, kernel_options=self.kernel_options,
                        enable_gqa=self.spec.num_heads != self.spec.num_kv_heads, **self.lse_kw)
        if not self.returns_lse:
            return out[0].transpose(0, 1)
        o, aux = out
        lse = getattr(aux, "lse", aux)  # AuxOutput (torch >= 2.9) or the bare tensor (return_lse)
        return o[0].transpose(0, 1), lse[0].transpose(0, 1).float()

    def _mask_mod(self, meta: VarlenMeta, device):
        if self.spec.mask == "dense":
            mask = meta.mask_TS
            return lambda b, h, i, j: mask[i, j]
        cq, ck = meta.cu_seqlens_q_host, meta.cu_seqlens_k_host
        lq, lk = lengths(cq), lengths(ck)
        doc_q = torch.repeat_interleave(torch.arange(len(lq)), torch.tensor(lq))
        doc_k = torch.repeat_interleave(torch.arange(len(lk)), torch.tensor(lk))
        if self.spec.mask != "causal":
            doc_q, doc_k = doc_q.to(device), doc_k.to(device)
            return lambda b, h, i, j: doc_q[i] == doc_k[j]
        # last key each query may see: its run's key start + its position + (Lk - Lq)
        pos_q = torch.arange(cq[-1]) - torch.tensor(cq[:-1])[doc_q]
        limit = torch.tensor(ck[:-1])[doc_q] + pos_q + (torch.tensor(lk) - torch.tensor(lq))[doc_q]
        doc_q, doc_k, limit = (x.to(device) for x in (doc_q, doc_k, limit))
        return lambda b, h, i, j: (doc_q[i] == doc_k[j]) & (j <= limit[i])


def build_flex(spec: AttentionSpec, caps: Caps, reject):
    if not caps.has_flex:
        return reject("flex: torch.nn.attention.flex_attention is not in this torch")
    if spec.paged:
        return reject("flex: paged KV is not implemented for flex; use varlen or sdpa")
    if spec.capturable:
        return reject("flex: the block mask is rebuilt from host lengths every call, so flex is not capturable")
    return FlexAttention(spec)


# ----------------------------------------------------------------- resolution


BUILDERS = {"fa3": build_fa3, "varlen": build_varlen, "sdpa": build_sdpa, "flex": build_flex}


def resolve(spec: AttentionSpec, caps: Caps, reject, builders=BUILDERS):
    """First backend that fits; a named ``spec.backend`` is the only one tried."""
    if spec.return_lse:  # ring attention: dense-masked partials merged by their log-sum-exp
        auto = LSE_BACKENDS
    else:
        auto = ("sdpa",) if spec.mask == "dense" else ("fa3", "varlen", "sdpa")
    impl = first_fit("cuda", spec, caps, reject, builders, auto, lse=LSE_BACKENDS, fp8=FP8_BACKENDS)
    if impl is not None and spec.backend == "auto" and "fa3" in auto and caps.sm[0] == 9 and caps.fa3_module is None:
        log_once(f"cuda: attention runs {impl.name}, not FA3: neither fa3_fwd_interface nor flash_attn_interface "
                 "is installed (pip install 'omni-run[cuda]' brings fa3-fwd)")
    return impl
