"""Modules whose math comes from kernels the platform resolved at build time.

Model code builds these with a ``Platform`` (``omni.platform_manager``); each
module asks for its kernel once in ``__init__`` and stores the returned
object, so ``forward`` calls a plain callable. Parameters keep the plain
``[O, I]`` weight under its checkpoint name until ``finalize()`` turns it into
the kernel's prepared form (for example FP8 with scales).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import quant as quant_math
from .specs import GROUPED_SMALL_ROWS, PDL_ROWS, SKINNY_ROWS, GemmSpec, GroupedGemmSpec, PreparedWeight

FP8_SCHEMES = ("fp8_row", "fp8_tensor")


def _adopt(module: nn.Module, p: PreparedWeight) -> PreparedWeight:
    """Make the kernel's prepared weight the module's state: ``weight`` and buffer ``weight_scale``.

    Both stay registered tensors, so ``state_dict``, ``.to()`` and the layer
    offloader (which swaps ``.data``) see them; the returned ``PreparedWeight``
    aliases those same tensor objects.
    """
    module.weight = nn.Parameter(p.data, requires_grad=False)
    module.weight_scale = p.scale
    return PreparedWeight(module.weight, module.weight_scale)


def _loaded_quantized(module: nn.Module) -> PreparedWeight | None:
    """The checkpoint's own e4m3 weight and scale, when ``declare_prequantized`` asked for them and they came.

    The weight parameter keeps ``model.dtype`` while loading (every e4m3 value
    is exact in bf16/fp32); it is cast back to e4m3 here. A scale still NaN
    was not in the checkpoint: that layer is quantized online instead.
    """
    scale = getattr(module, "weight_scale", None)
    if scale is None or module.prepared is not None or bool(torch.isnan(scale).any()):
        return None
    return PreparedWeight(module.weight.data.to(torch.float8_e4m3fn), scale.float())


def _prepare(module: nn.Module, kernel) -> PreparedWeight:
    pre = _loaded_quantized(module)
    if pre is None:
        return kernel.prepare_weight(module.weight.data)
    return getattr(kernel, "prepare_quantized", lambda w: w)(pre)


class Linear(nn.Module):
    """``y = x W^T + b`` through the platform's linear kernel for ``quant``."""

    def __init__(self, in_features: int, out_features: int, *, platform, dtype: torch.dtype,
                 bias: bool = False, quant: str = "none", memory_bound: str = "auto", fast_accum: bool = False,
                 skinny_rows: int = SKINNY_ROWS, pdl_rows: int = PDL_ROWS):
        super().__init__()
        self.spec = GemmSpec(in_features=in_features, out_features=out_features, dtype=dtype, quant=quant, bias=bias,
                             memory_bound=memory_bound, fast_accum=fast_accum, skinny_rows=skinny_rows,
                             pdl_rows=pdl_rows)
        self.kernel = platform.linear(self.spec)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.register_buffer("weight_scale", None)
        self.prepared: PreparedWeight | None = None

    def finalize(self) -> None:
        """Prepare the loaded weight for the kernel (once, after loading); pre-quantized weights are adopted."""
        self.prepared = _adopt(self, _prepare(self, self.kernel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.prepared or PreparedWeight(self.weight)
        return self.kernel(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"{self.spec.in_features}->{self.spec.out_features}, quant={self.spec.quant}, kernel={self.kernel.name}"


class GroupedLinear(nn.Module):
    """Per-expert weights ``[E, O, I]`` applied to expert-sorted rows via the grouped GEMM kernel."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, platform,
                 dtype: torch.dtype, quant: str = "none", fast_accum: bool = False, grouped_fp8: str = "auto",
                 small_rows: int = GROUPED_SMALL_ROWS):
        super().__init__()
        self.spec = GroupedGemmSpec(num_experts=num_experts, in_features=in_features, out_features=out_features,
                                    dtype=dtype, quant=quant, fast_accum=fast_accum, grouped_fp8=grouped_fp8,
                                    small_rows=small_rows)
        self.kernel = platform.grouped_gemm(self.spec)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype),
                                   requires_grad=False)
        self.register_buffer("weight_scale", None)
        self.prepared: PreparedWeight | None = None

    def finalize(self) -> None:
        self.prepared = _adopt(self, _prepare(self, self.kernel))

    def forward(self, x_TI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return self.kernel(x_TI, self.prepared or PreparedWeight(self.weight), offsets_E)


def embedding(num: int, dim: int, *, dtype: torch.dtype, padding_idx: int | None = None) -> nn.Embedding:
    """``nn.Embedding`` that skips its random init on the meta device (the build's modules, filled later).

    Why: ``normal_`` on a meta tensor goes through ``torch._refs``, whose first import took 1.2-1.9 s on the
    development CPU: a third of the default CPU job's wall time (``pipeline ready`` logs the phases). On a
    real device the init runs as ``nn.Embedding``'s own."""
    e = nn.Embedding(num, dim, padding_idx=padding_idx, _weight=torch.empty(num, dim, dtype=dtype))
    if not e.weight.is_meta:
        e.reset_parameters()
    return e


class KernelOwner(nn.Module):
    """A module whose kernel prepares its child ``GroupedLinear`` weights itself (the MoE experts)."""

    def finalize(self) -> None:
        raise NotImplementedError


def unhooked(module: nn.Module) -> bool:
    """Whether no forward (pre-)hook is attached to ``module``. A parallel plan attaches its collectives as
    hooks (an all-reduce of the output, expert dispatch), so work may only be fused across the module's
    boundary, e.g. a residual added inside its last kernel, when this holds."""
    return not (module._forward_hooks or module._forward_pre_hooks)  # torch has no public getter for these


def finalize_experts(moe, gate_and_up: GroupedLinear, down: GroupedLinear) -> None:
    """Prepare both expert weights with the MoE kernel ``moe`` and make them the modules' state.

    Pre-quantized experts (``declare_prequantized``) are adopted through the
    kernel's ``prepare_quantized_weights`` when it has one, else dequantized
    and prepared again (exact for the reference layouts).
    """
    pre13, pre2 = _loaded_quantized(gate_and_up), _loaded_quantized(down)
    if pre13 is not None and pre2 is not None and hasattr(moe, "prepare_quantized_weights"):
        p = moe.prepare_quantized_weights(pre13, pre2)
    else:
        w13 = gate_and_up.weight.data if pre13 is None else quant_math.dequantize(pre13).to(gate_and_up.spec.dtype)
        w2 = down.weight.data if pre2 is None else quant_math.dequantize(pre2).to(down.spec.dtype)
        p = moe.prepare_weights(w13, w2)
    gate_and_up.prepared, down.prepared = _adopt(gate_and_up, p.w13), _adopt(down, p.w2)


def declare_prequantized(model: nn.Module) -> int:
    """Ask for a checkpoint's FP8 scales (ModelOpt names): ``weight_scale`` / ``input_scale`` buffers.

    Every fp8 ``Linear`` / ``GroupedLinear`` gets a NaN ``weight_scale``
    (``[O, 1]`` for fp8_row, ``[]`` for fp8_tensor; ``[E, O, 1]`` / ``[E, 1, 1]``
    stacked) and ``input_scale`` (``[]`` / ``[E]``) that the loader fills
    (``omni.weights``: scales match by element count, and a single value
    broadcasts, so per-tensor checkpoint scales serve fp8_row). ``finalize``
    then adopts the e4m3 weights as they are. ``input_scale`` (ModelOpt's
    static activation scale) is kept for the record; the kernels quantize
    activations dynamically. Returns the number of layers declared.
    """
    n = 0
    for m in model.modules():
        if not isinstance(m, (Linear, GroupedLinear)) or m.spec.quant not in FP8_SCHEMES or m.prepared is not None:
            continue
        w = m.weight
        lead = tuple(w.shape[:1]) if isinstance(m, GroupedLinear) else ()
        rows = w.shape[-2] if m.spec.quant == "fp8_row" else 1
        shape = lead + ((rows, 1) if (lead or m.spec.quant == "fp8_row") else ())
        m.register_buffer("weight_scale", torch.full(shape, float("nan"), dtype=torch.float32, device=w.device))
        m.register_buffer("input_scale", torch.full(lead, float("nan"), dtype=torch.float32, device=w.device))
        n += 1
    return n


def finalize_all(model: nn.Module) -> None:
    """Call ``finalize()`` on every kernel-backed module after weights are loaded (MoE owners first)."""
    for m in model.modules():
        if isinstance(m, KernelOwner) and any(c.prepared is None for c in m.children() if isinstance(c, GroupedLinear)):
            m.finalize()  # once: a part finalized before (a layer built on its own) is left as it is
    for m in model.modules():
        if isinstance(m, (Linear, GroupedLinear)) and m.prepared is None:
            m.finalize()
