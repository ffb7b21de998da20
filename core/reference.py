"""The reference platform: pure PyTorch answers to every hook (the ``cpu`` platform).

Registered after the active platform with ``trylast=True``, so it answers
whatever a platform declines; it is also the oracle of the conformance suite
and the executable documentation of each hook's semantics. It favours
clarity over speed: loops over sequences and experts, explicit masks, and
fp32 dequantized products for quantized GEMMs. Not capturable.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import quant
from .device import DeviceServices
from .hookspecs import hookimpl
from .reference_glue import ReferenceGlue
from .specs import (AttentionSpec, GemmSpec, GlueSpec, GroupedGemmSpec, MoESpec, PlatformInfo, PreparedMoE,
                    PreparedWeight, RowQuantized, VarlenMeta)

REFERENCE_QUANT = ("none", "fp8_tensor", "fp8_row", "w8a8")
NO_TRITON = "reference: kernels.memory_bound=triton cannot be met: the reference runs plain torch ops (no Triton)"
MET_CHOICES = ("auto", "torch")  # kernels.grouped_fp8 values the reference meets (the others name a vendor kernel)


def no_vendor_kernel(choice: str) -> str:
    return f"reference: kernels.grouped_fp8={choice} cannot be met: the reference's expert products are torch ops"


def causal_mask(lq: int, lk: int, device) -> torch.Tensor:
    """Bottom-right aligned causal mask ``[lq, lk]`` (True = attend), as FlashAttention."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


def sdpa_TNH(q_TNH, k_SKH, v_SKH, mask_TS, scale: float) -> torch.Tensor:
    """One attention over ``[T, N, H]`` queries and ``[S, K, H]`` keys with GQA expansion."""
    rep = q_TNH.shape[1] // k_SKH.shape[1]
    k_SNH = k_SKH.repeat_interleave(rep, dim=1)
    v_SNH = v_SKH.repeat_interleave(rep, dim=1)
    # 4-D BNSD inputs: 3-D ones send the CPU to the slow math kernel (10x here).
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q_TNH, k_SNH, v_SNH))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_TS, scale=scale)
    return _zero_unseen(o[0].transpose(0, 1), mask_TS)


def paged_keys(pool_PGKH: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    """Gather one sequence's ``[length, K, H]`` keys from a paged pool."""
    return pool_PGKH[pages].flatten(0, 1)[:length]


def attention_lse_TNH(q_TNH, k_SKH, v_SKH, mask_TS, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the log-sum-exp of the scores: ``(o_TNH, lse_TN)``, both in fp32 math.

    A query that sees no key gets ``o = 0`` and ``lse = -inf`` (so merging it is a no-op).
    """
    rep = q_TNH.shape[1] // k_SKH.shape[1]
    k_NSH = k_SKH.repeat_interleave(rep, dim=1).transpose(0, 1).float()
    v_NSH = v_SKH.repeat_interleave(rep, dim=1).transpose(0, 1).float()
    s_NTS = torch.matmul(q_TNH.transpose(0, 1).float(), k_NSH.transpose(1, 2)) * scale
    if mask_TS is not None:
        s_NTS = s_NTS.masked_fill(~mask_TS, float("-inf"))
    lse_NT = torch.logsumexp(s_NTS, dim=-1)
    p_NTS = torch.exp(s_NTS - lse_NT[..., None]).nan_to_num(0.0)
    o_NTH = torch.matmul(p_NTS, v_NSH)
    return o_NTH.transpose(0, 1).to(q_TNH.dtype), lse_NT.transpose(0, 1).contiguous()


class ReferenceAttention:
    name = "reference-sdpa"

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.scale = spec.scale or 1.0 / math.sqrt(spec.head_dim)
        self.returns_lse = spec.return_lse
        if spec.return_lse:
            self.name = "reference-lse"

    def __call__(self, q_TNH, k, v, meta: VarlenMeta):
        if self.spec.fp8:  # the products see e4m3 values: quantize per tensor, compute on the dequantized values
            q_TNH, k, v = (quant.fake_quantize_fp8(t) for t in (q_TNH, k, v))
        if self.spec.return_lse:
            return self._with_lse(q_TNH, k, v, meta)
        if self.spec.mask == "dense":
            return sdpa_TNH(q_TNH, k, v, meta.mask_TS, self.scale)
        outs = [self._one(b, q_TNH, k, v, meta) for b in range(meta.num_seqs)]
        return torch.cat(outs) if outs else q_TNH.new_empty(q_TNH.shape)

    def _sequence(self, b: int, q_TNH, k, v, meta: VarlenMeta):
        """Query run ``b``, its keys and values (from the pool when paged) and its mask."""
        q0, q1 = meta.cu_seqlens_q_host[b], meta.cu_seqlens_q_host[b + 1]
        if self.spec.paged:
            pages, n = meta.block_table_BP[b].tolist(), int(meta.seqused_k_B[b])
            kb, vb = paged_keys(k, pages, n), paged_keys(v, pages, n)
        else:
            k0, k1 = meta.cu_seqlens_k_host[b], meta.cu_seqlens_k_host[b + 1]
            kb, vb = k[k0:k1], v[k0:k1]
        mask = causal_mask(q1 - q0, kb.shape[0], q_TNH.device) if self.spec.mask == "causal" else None
        return q_TNH[q0:q1], kb, vb, mask

    def _one(self, b: int, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
        return sdpa_TNH(*self._sequence(b, q_TNH, k, v, meta), self.scale)

    def _with_lse(self, q_TNH, k, v, meta: VarlenMeta):
        """``(o_TNH, lse_TN)``; dense masks only over the packed tokens, else per sequence."""
        if self.spec.mask == "dense":
            return attention_lse_TNH(q_TNH, k, v, meta.mask_TS, self.scale)
        pairs = [attention_lse_TNH(*self._sequence(b, q_TNH, k, v, meta), self.scale) for b in range(meta.num_seqs)]
        return torch.cat([o for o, _ in pairs]), torch.cat([lse for _, lse in pairs])


def _zero_unseen(o_TNH: torch.Tensor, mask_TS: torch.Tensor | None) -> torch.Tensor:
    """A query that may see no key outputs zeros (the contract), not SDPA's NaN."""
    if mask_TS is None:
        return o_TNH
    return o_TNH.masked_fill(~mask_TS.any(-1)[:, None, None], 0.0)


class ReferenceLinear:
    def __init__(self, spec: GemmSpec):
        self.spec = spec
        self.name = f"reference-linear[{spec.quant}]"
        self.accepts_row_quantized = spec.quant == "fp8_row"

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight:
        return quant.prepare_weight(w_OI, self.spec.quant)

    def __call__(self, x_TI, w: PreparedWeight, bias_O=None) -> torch.Tensor:
        if isinstance(x_TI, RowQuantized):  # the same product, with the rows quantized already
            y = quant.rows_linear(x_TI.q_TI, x_TI.scale_T1, w, self.spec.dtype)
        else:
            y = quant.quantized_linear(x_TI.to(self.spec.dtype), w, self.spec.quant)
        return y if bias_O is None else y + bias_O


class ReferenceGroupedGemm:
    def __init__(self, spec: GroupedGemmSpec):
        self.spec = spec
        self.name = f"reference-grouped[{spec.quant}]"

    def prepare_weight(self, w_EOI: torch.Tensor) -> PreparedWeight:
        return quant.prepare_weight(w_EOI, self.spec.quant)

    def __call__(self, x_TI, w: PreparedWeight, offsets_E) -> torch.Tensor:
        y = x_TI.new_empty(x_TI.shape[0], self.spec.out_features)
        start = 0
        for e, end in enumerate(offsets_E.tolist()):
            if end > start:  # empty groups have nothing to quantize or multiply
                we = PreparedWeight(w.data[e], None if w.scale is None else w.scale[e])
                y[start:end] = quant.quantized_linear(x_TI[start:end], we, self.spec.quant)
            start = end
        return y


class ReferenceMoE:
    """Routed experts: sort rows by expert, one SwiGLU per expert, weighted fp32 sum (reads counts on the host)."""

    def __init__(self, spec: MoESpec):
        self.spec = spec
        self.name = f"reference-moe[{spec.quant}]"
        from .moe import expert_gemm_specs

        self.gemm13, self.gemm2 = (ReferenceGroupedGemm(g) for g in expert_gemm_specs(spec))

    def prepare_weights(self, w13_EOI: torch.Tensor, w2_EOI: torch.Tensor) -> PreparedMoE:
        return PreparedMoE(self.gemm13.prepare_weight(w13_EOI), self.gemm2.prepare_weight(w2_EOI))

    def prepare_quantized_weights(self, w13: PreparedWeight, w2: PreparedWeight) -> PreparedMoE:
        """A checkpoint's e4m3 experts are already in the reference layout."""
        return PreparedMoE(w13, w2)

    def __call__(self, x_TD, topk_weights_Tk, topk_ids_Tk, prepared: PreparedMoE) -> torch.Tensor:
        from .moe import combine, sort_by_expert, swiglu

        routing = sort_by_expert(topk_ids_Tk, prepared.w13.data.shape[0])
        h = self.gemm13(x_TD[routing.token_R].to(self.spec.dtype), prepared.w13, routing.offsets_E)
        y = self.gemm2(swiglu(h), prepared.w2, routing.offsets_E)
        return combine(y, routing, topk_weights_Tk, x_TD.dtype)


class ReferencePlatform:
    """Hook implementations of the reference (``cpu``) platform."""

    name = "cpu"

    @hookimpl(trylast=True)
    def omni_platform_detect(self, reject) -> PlatformInfo:
        return PlatformInfo(name="cpu", device_type="cpu", dist_backend="gloo", device_count=1,
                            device_name="CPU (reference PyTorch)", accelerator=False)

    @hookimpl(trylast=True)
    def omni_platform_configure(self, info, local_rank) -> bool:
        return True

    @hookimpl(trylast=True)
    def omni_device_services(self, info: PlatformInfo) -> DeviceServices:
        return DeviceServices(info.device_type, 0)

    @hookimpl(trylast=True)
    def omni_dist_backend(self, info: PlatformInfo) -> str:
        return info.dist_backend

    @hookimpl(trylast=True)
    def omni_shared_device_env(self, info: PlatformInfo, rank: int, backend: str) -> dict:
        return {}

    @hookimpl(trylast=True)
    def omni_attention_impl(self, spec: AttentionSpec, reject):
        if spec.backend not in ("auto", "sdpa"):
            return reject(f"reference: is SDPA, not the requested backend {spec.backend!r}")
        if spec.capturable:
            return reject("reference: not capturable (reads sequence lengths on the host)")
        return ReferenceAttention(spec)

    @hookimpl(trylast=True)
    def omni_linear_impl(self, spec: GemmSpec, reject):
        if spec.memory_bound == "triton":
            return reject(NO_TRITON)
        if spec.quant not in REFERENCE_QUANT:
            return reject(f"reference: quant {spec.quant!r} has no reference semantics yet")
        return ReferenceLinear(spec)

    @hookimpl(trylast=True)
    def omni_grouped_gemm_impl(self, spec: GroupedGemmSpec, reject):
        if spec.grouped_fp8 not in MET_CHOICES and spec.quant != "none":
            return reject(no_vendor_kernel(spec.grouped_fp8))
        if spec.quant not in REFERENCE_QUANT:
            return reject(f"reference: quant {spec.quant!r} has no reference semantics yet")
        return ReferenceGroupedGemm(spec)

    @hookimpl(trylast=True)
    def omni_moe_impl(self, spec: MoESpec, reject):
        if spec.memory_bound == "triton":
            return reject(NO_TRITON)
        if spec.grouped_fp8 not in MET_CHOICES and spec.quant != "none":
            return reject(no_vendor_kernel(spec.grouped_fp8))
        if spec.capturable:
            return reject("reference: not capturable (reads expert counts on the host)")
        if spec.quant not in REFERENCE_QUANT:
            return reject(f"reference: quant.scheme={spec.quant!r} has no reference semantics yet "
                          f"(reference schemes: {', '.join(REFERENCE_QUANT)})")
        return ReferenceMoE(spec)

    @hookimpl(trylast=True)
    def omni_glue_impl(self, spec: GlueSpec, reject):
        if spec.memory_bound == "triton":
            return reject(NO_TRITON)
        return ReferenceGlue(spec)

    @hookimpl(trylast=True)
    def omni_check_recipe(self, recipe, info, reject) -> None:
        scheme = getattr(getattr(recipe, "quant", None), "scheme", "none")
        if info.name == "cpu" and scheme not in REFERENCE_QUANT:
            reject(f"quant.scheme={scheme}: the reference (cpu) platform has no {scheme} semantics "
                   f"(block-scaled formats need a device with native support, e.g. CUDA sm100)")

    @hookimpl(trylast=True)
    def omni_graph_runner_impl(self, spec, reject):
        return reject("reference: runs eagerly (no graph capture)")


plugin = ReferencePlatform()
