"""Routed-expert building blocks shared by MoE implementations (``omni_moe_impl``).

``sort_by_expert`` permutes routed rows by expert without a host sync (one
stable sort and a ``searchsorted`` for the group ends); ``combine`` adds each
token's ``k`` expert outputs back with its routing weights in fp32.
``ComposedMoE`` is the MoE of a device platform that has grouped GEMM
kernels but no fused MoE: the same sort, the platform's two grouped GEMMs,
SwiGLU and the combine, as separate torch ops (capturable when the grouped
kernels are).

Shape suffixes: T tokens, k experts per token, R = T*k routed rows, D width,
I expert width, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .specs import GroupedGemmSpec, MoESpec, PreparedMoE


def swiglu(x_R2I: torch.Tensor) -> torch.Tensor:
    """``x1 * silu(x2)``: SiLU gates with the SECOND half (HunyuanImage-3 order)."""
    x1, x2 = x_R2I.chunk(2, dim=-1)
    return x1 * F.silu(x2)


@dataclass
class Routing:
    """Routed rows sorted by expert: row ``r`` of the sorted order is assignment ``order_R[r]``."""

    order_R: torch.Tensor  # int64: flat index ``t*k + j`` of each sorted row
    token_R: torch.Tensor  # int64: token of each sorted row
    offsets_E: torch.Tensor  # int32: cumulative row ends per expert

    def inverse(self) -> torch.Tensor:
        """int64 sorted row of each assignment ``t*k + j`` (the combine's gather index)."""
        inverse_R = torch.empty_like(self.order_R)
        inverse_R[self.order_R] = torch.arange(self.order_R.numel(), device=self.order_R.device)
        return inverse_R


def sort_by_expert(topk_ids_Tk: torch.Tensor, num_experts: int) -> Routing:
    """Stable sort of the ``T*k`` assignments by expert; no host sync."""
    expert_R = topk_ids_Tk.flatten()
    sorted_R, order_R = torch.sort(expert_R, stable=True)
    bounds_E = torch.arange(num_experts, device=expert_R.device, dtype=sorted_R.dtype)
    offsets_E = torch.searchsorted(sorted_R, bounds_E, right=True).to(torch.int32)
    return Routing(order_R, order_R // topk_ids_Tk.shape[1], offsets_E)


def combine(y_RD: torch.Tensor, routing: Routing, topk_weights_Tk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * y[row of (t, j)]`` in fp32, as ``dtype``."""
    return weighted_sum(y_RD, routing.inverse(), topk_weights_Tk).to(dtype)


def weighted_sum(y_RD: torch.Tensor, inverse_R: torch.Tensor, topk_weights_Tk: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, D]``: ``sum_j w[t, j] * y[inverse[t*k + j]]`` (``inverse``: ``Routing.inverse()``)."""
    T, k = topk_weights_Tk.shape
    y_TkD = y_RD[inverse_R].view(T, k, y_RD.shape[-1]).float()  # explicit: T may be 0 (an idle sp rank)
    return torch.einsum("tkd,tk->td", y_TkD, topk_weights_Tk.float())


def add_terms(acc_TD: torch.Tensor, addends: tuple) -> torch.Tensor:
    """``sum(addends) + acc`` in fp32, the addends first and in order: the combine of an MoE kernel that
    ``accepts_addends`` (``omni_moe_impl``), rounded once afterwards."""
    if not addends:
        return acc_TD
    total = addends[0].float()
    for a in addends[1:]:
        total = total + a.float()
    return total + acc_TD


def expert_gemm_specs(spec: MoESpec) -> tuple[GroupedGemmSpec, GroupedGemmSpec]:
    """The grouped GEMMs of ``spec``: gate_and_up ``[E, 2I, D]`` and down ``[E, D, I]``."""
    kw = dict(num_experts=spec.num_experts, dtype=spec.dtype, quant=spec.quant, fast_accum=spec.fast_accum,
              grouped_fp8=spec.grouped_fp8, small_rows=spec.small_rows)
    return (GroupedGemmSpec(in_features=spec.hidden, out_features=2 * spec.inner, **kw),
            GroupedGemmSpec(in_features=spec.inner, out_features=spec.hidden, **kw))


def composed_moe(spec: MoESpec, resolve_grouped, reject):
    """``ComposedMoE`` over ``resolve_grouped(spec, reject)``; None (after the refusals) if either GEMM is refused."""
    if spec.memory_bound == "triton":
        return reject("composed MoE: kernels.memory_bound=triton cannot be met: the steps between the grouped "
                      "GEMMs run as torch ops")
    gemms = [resolve_grouped(g, reject) for g in expert_gemm_specs(spec)]
    return None if None in gemms else ComposedMoE(spec, *gemms)


class ComposedMoE:
    """Sort, two grouped GEMMs of the platform, SwiGLU and combine as separate ops."""

    def __init__(self, spec: MoESpec, gemm13, gemm2):
        self.spec, self.gemm13, self.gemm2 = spec, gemm13, gemm2
        self.name = f"composed-moe[{gemm13.name}]"

    def prepare_weights(self, w13_EOI: torch.Tensor, w2_EOI: torch.Tensor) -> PreparedMoE:
        return PreparedMoE(self.gemm13.prepare_weight(w13_EOI), self.gemm2.prepare_weight(w2_EOI))

    def prepare_quantized_weights(self, w13, w2) -> PreparedMoE:
        """A checkpoint's e4m3 experts, re-laid out by each grouped kernel that asks for it."""
        return PreparedMoE(*(getattr(g, "prepare_quantized", lambda w: w)(w)
                             for g, w in ((self.gemm13, w13), (self.gemm2, w2))))

    def __call__(self, x_TD, topk_weights_Tk, topk_ids_Tk, prepared: PreparedMoE) -> torch.Tensor:
        routing = sort_by_expert(topk_ids_Tk, prepared.w13.data.shape[0])
        h = self.gemm13(x_TD[routing.token_R], prepared.w13, routing.offsets_E)
        y = self.gemm2(swiglu(h), prepared.w2, routing.offsets_E)
        return combine(y, routing, topk_weights_Tk, x_TD.dtype)
