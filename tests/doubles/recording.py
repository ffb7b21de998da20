"""Call records, contract checks and the reference computation shared by the doubles."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni.reference import ReferenceAttention
from omni.specs import AttentionSpec, VarlenMeta


class ContractViolation(AssertionError):
    """A call the real vendor op would reject or misread (the message says which rule)."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractViolation(message)


@dataclass(frozen=True)
class TensorArg:
    """What a kernel sees of a tensor argument."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    stride: tuple[int, ...]
    contiguous: bool


def describe(value: object) -> object:
    """Tensors become ``TensorArg``; lists and tuples are described element-wise; the rest is kept."""
    if isinstance(value, torch.Tensor):
        return TensorArg(tuple(value.shape), value.dtype, value.device.type, tuple(value.stride()),
                         value.is_contiguous())
    if isinstance(value, (list, tuple)):
        return type(value)(describe(v) for v in value)
    return value


@dataclass
class Call:
    fn: str
    args: dict[str, object]
    notes: dict[str, object] = field(default_factory=dict)  # conventions the double read off the call

    def __getitem__(self, name: str) -> object:
        return self.args[name]


class Recorder:
    """Every call one double received, in order."""

    def __init__(self):
        self.calls: list[Call] = []

    def record(self, fn: str, **args) -> Call:
        call = Call(fn, {name: describe(value) for name, value in args.items()})
        self.calls.append(call)
        return call

    def of(self, fn: str) -> list[Call]:
        return [c for c in self.calls if c.fn == fn]


# ----------------------------------------------------------------- the two sequence-length conventions


def _cumulative(name: str, values: list[int], total: int) -> None:
    require(all(b >= a for a, b in zip(values, values[1:])),
            f"{name} must be non-decreasing cumulative offsets, got {values}")
    require(values[-1] == total, f"{name} ends at {values[-1]} but the packed tensor has {total} tokens")


def cuda_offsets(name: str, t: object, total: int) -> list[int]:
    """CUDA/ROCm/XPU: an int32 device tensor of B+1 cumulative offsets starting at 0."""
    require(isinstance(t, torch.Tensor),
            f"{name} must be an int32 tensor of cumulative offsets, got {type(t).__name__}")
    require(t.dtype == torch.int32 and t.dim() == 1 and t.numel() >= 2,
            f"{name} must be a 1-D int32 tensor with B+1 entries, got {t.dtype} {tuple(t.shape)}")
    values = t.tolist()
    require(values[0] == 0, f"{name} must start with 0 (B+1 offsets, CUDA convention), got {values}")
    _cumulative(name, values, total)
    return values


def ascend_ends(name: str, value: object, total: int) -> list[int]:
    """Ascend TND: a HOST list[int] of B cumulative ends without the leading 0 ([2,2,2] -> [2,4,6])."""
    require(isinstance(value, (list, tuple)) and all(type(x) is int for x in value),
            f"{name} must be a host list[int] (Ascend), got {type(value).__name__}")
    values = list(value)
    require(len(values) >= 1, f"{name} must hold one cumulative end per sequence, got none")
    require(values[0] != 0, f"{name} starts with 0: Ascend takes cumulative ends WITHOUT the leading 0 "
                            f"(lengths 2,2,2 -> [2, 4, 6]), got {values}")
    _cumulative(name, values, total)
    return values


def host_lengths(name: str, value: object) -> list[int]:
    require(isinstance(value, (list, tuple)) and all(type(x) is int for x in value),
            f"{name} must be a host list[int] (Ascend), got {type(value).__name__}")
    return list(value)


# ----------------------------------------------------------------- the reference computation


def reference_attention(q_TNH, k, v, cu_q: list[int], cu_k: list[int], *, causal: bool, scale: float,
                        block_table=None, seqused=None, page_size: int = 0) -> torch.Tensor:
    """``omni.reference`` attention in fp32 on the conventions the double read off the call."""
    paged = block_table is not None
    spec = AttentionSpec(num_heads=q_TNH.shape[1], num_kv_heads=k.shape[-2], head_dim=q_TNH.shape[-1],
                         dtype=torch.float32, mask="causal" if causal else "none", paged=paged,
                         page_size=page_size if paged else 0, scale=scale)
    meta = VarlenMeta(cu_seqlens_q_B1=torch.tensor(cu_q, dtype=torch.int32),
                      cu_seqlens_k_B1=torch.tensor(cu_k, dtype=torch.int32),
                      max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
                      max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])),
                      cu_seqlens_q_host=tuple(cu_q), cu_seqlens_k_host=tuple(cu_k),
                      block_table_BP=None if not paged else block_table.cpu(),
                      seqused_k_B=None if not paged else torch.tensor(seqused, dtype=torch.int32))
    out = ReferenceAttention(spec)(q_TNH.float().cpu(), k.float().cpu(), v.float().cpu(), meta)
    return out.to(q_TNH.dtype).to(q_TNH.device)


def cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out
