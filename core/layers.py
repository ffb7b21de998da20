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

from .specs import GemmSpec, GroupedGemmSpec, PreparedWeight


def _adopt(module: nn.Module, p: PreparedWeight) -> PreparedWeight:
    """Make the kernel's prepared weight the module's state: ``weight`` and buffer ``weight_scale``.

    Both stay registered tensors, so ``state_dict``, ``.to()`` and the layer
    offloader (which swaps ``.data``) see them; the returned ``PreparedWeight``
    aliases those same tensor objects.
    """
    module.weight = nn.Parameter(p.data, requires_grad=False)
    module.weight_scale = p.scale
    return PreparedWeight(module.weight, module.weight_scale)


class Linear(nn.Module):
    """``y = x W^T + b`` through the platform's linear kernel for ``quant``."""

    def __init__(self, in_features: int, out_features: int, *, platform, dtype: torch.dtype,
                 bias: bool = False, quant: str = "none"):
        super().__init__()
        self.spec = GemmSpec(in_features=in_features, out_features=out_features, dtype=dtype, quant=quant, bias=bias)
        self.kernel = platform.linear(self.spec)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.register_buffer("weight_scale", None)
        self.prepared: PreparedWeight | None = None

    def finalize(self) -> None:
        """Prepare the loaded weight for the kernel (once, after loading)."""
        self.prepared = _adopt(self, self.kernel.prepare_weight(self.weight.data))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.prepared or PreparedWeight(self.weight)
        return self.kernel(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"{self.spec.in_features}->{self.spec.out_features}, quant={self.spec.quant}, kernel={self.kernel.name}"


class GroupedLinear(nn.Module):
    """Per-expert weights ``[E, O, I]`` applied to expert-sorted rows via the grouped GEMM kernel."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, platform,
                 dtype: torch.dtype, quant: str = "none"):
        super().__init__()
        self.spec = GroupedGemmSpec(num_experts=num_experts, in_features=in_features,
                                    out_features=out_features, dtype=dtype, quant=quant)
        self.kernel = platform.grouped_gemm(self.spec)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype), requires_grad=False)
        self.register_buffer("weight_scale", None)
        self.prepared: PreparedWeight | None = None

    def finalize(self) -> None:
        self.prepared = _adopt(self, self.kernel.prepare_weight(self.weight.data))

    def forward(self, x_TI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return self.kernel(x_TI, self.prepared or PreparedWeight(self.weight), offsets_E)


def finalize_all(model: nn.Module) -> None:
    """Call ``finalize()`` on every kernel-backed module after weights are loaded."""
    for m in model.modules():
        if isinstance(m, (Linear, GroupedLinear)) and m.prepared is None:
            m.finalize()
