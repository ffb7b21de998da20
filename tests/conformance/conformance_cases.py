"""Spec grid, input builders and oracles shared by the conformance tests.

Two oracles, both computed on the CPU:

- ``naive_*``: written here, independently of ``omni.reference`` (explicit
  einsum softmax with explicit masks, explicit fp8 quantize / dequantize and
  a float64 matmul), used for the ``cpu`` platform, whose kernels *are* the
  reference, so that the check can fail;
- ``reference_*``: the reference platform's own kernels run in float32 on
  the CPU, used for accelerator platforms.

Shape suffixes as in ``omni.specs``: T queries, S keys, N heads, K kv heads,
H head dim, P pages, G page size, B sequences, I/O features, E experts.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import defaultdict
from typing import Callable

import torch
import torch.nn.functional as F

from omni import platform_manager
from omni.reference import ReferenceAttention, ReferenceGroupedGemm, ReferenceLinear
from omni.specs import AttentionSpec, GemmSpec, GroupedGemmSpec, MoESpec, VarlenMeta

FP8_MAX = 448.0  # OCP e4m3, written out here on purpose (independent of omni.quant)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {
    torch.float32: dict(atol=2e-4, rtol=2e-4),
    torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}
# (query lengths, key lengths) per sequence; no zero lengths, q never longer than k
BATCHES = {
    "mixed": ([1, 17, 64], [1, 17, 64]),
    "q<k": ([5, 17, 32], [40, 17, 100]),
    "equal": ([16, 16, 16, 16], [48, 48, 48, 48]),
}
GQA = {1: (4, 4), 4: (8, 2)}  # ratio -> (num_heads, num_kv_heads)

# a ROCm torch answers torch.cuda too, but the rocm platform serves it: cuda-only cases skip there
ROCM_BUILD = torch.version.hip is not None
NOT_CUDA_ON_ROCM = (f"cuda: this torch is a ROCm build (torch.version.hip={torch.version.hip}); "
                    "the rocm platform serves it")

# platform name -> zero-argument callable returning a ``Platform``, registered by other suites
PROVIDERS: dict[str, Callable[[], platform_manager.Platform]] = {}


def register_platform_provider(name: str, provider: Callable[[], platform_manager.Platform]) -> None:
    """Let another suite supply platform ``name``, e.g. one backed by doubles (tests/contract).

    ``get_platform(name)`` then asks ``provider`` on every call and caches
    nothing: the provider owns the platform's lifetime (a double-backed one
    lives as long as its ``monkeypatch``). ``unregister_platform_provider``
    when the supplying fixture ends.
    """
    PROVIDERS[name] = provider


def unregister_platform_provider(name: str) -> None:
    PROVIDERS.pop(name, None)


def get_platform(name: str):
    """The platform under test: a registered provider's, else one selected per name for the session."""
    provider = PROVIDERS.get(name)
    return provider() if provider is not None else _selected_platform(name)


@functools.lru_cache(maxsize=None)
def _selected_platform(name: str):
    """One selected ``Platform`` per name for the whole session, bound to device 0."""
    platform = platform_manager.select(name)
    platform.device_services(0)
    return platform


def device_of(name: str) -> str:
    return get_platform(name).info.device_type


# which kernel answered which spec, printed at the end of the session (conftest)
RESOLVED: dict[tuple, set[str]] = defaultdict(set)


def attention_grid():
    """(dtype, head_dim, gqa, mask, page_size, batch); page_size 0 = not paged; dense is never paged."""
    for dt, hd, gqa, mask, page, batch in itertools.product(DTYPES, (64, 128), GQA, ("none", "causal", "dense"),
                                                             (0, 16, 256), BATCHES):
        if not (mask == "dense" and page):
            yield dt, hd, gqa, mask, page, batch


def attention_spec(dtype, head_dim, gqa, mask, page, backend="auto", capturable=False) -> AttentionSpec:
    n, k = GQA[gqa]
    return AttentionSpec(num_heads=n, num_kv_heads=k, head_dim=head_dim, dtype=DTYPES[dtype], mask=mask,
                         paged=bool(page), page_size=page, backend=backend, capturable=capturable)


def _cu(lengths) -> tuple[int, ...]:
    return tuple(itertools.accumulate(lengths, initial=0))


def make_attention_case(spec: AttentionSpec, batch: str, device, seed: int = 0):
    """Random packed q/k/v (k/v as page pools when paged) and the matching ``VarlenMeta``."""
    g = torch.Generator().manual_seed(seed)
    lq, lk = BATCHES[batch]
    cu_q, cu_k = _cu(lq), _cu(lk)
    n, kh, h = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(spec.dtype)

    q = rand(cu_q[-1], n, h)
    extra = {}
    if spec.paged:
        k, v, extra = _paged_pools(lk, spec.page_size, kh, h, g, rand)
    else:
        k, v = rand(cu_k[-1], kh, h), rand(cu_k[-1], kh, h)
    if spec.mask == "dense":
        extra["mask_TS"] = _dense_mask(lq, lk, g)
    meta = VarlenMeta(
        cu_seqlens_q_B1=torch.tensor(cu_q, dtype=torch.int32), cu_seqlens_k_B1=torch.tensor(cu_k, dtype=torch.int32),
        max_seqlen_q=max(lq), max_seqlen_k=max(lk), cu_seqlens_q_host=cu_q, cu_seqlens_k_host=cu_k, **extra)
    return q.to(device), k.to(device), v.to(device), meta_to(meta, device)


def _paged_pools(lk, page, kh, h, g, rand):
    pages = [math.ceil(n / page) for n in lk]
    num_pages = sum(pages) + 3  # a few pages nobody owns
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.zeros(len(lk), max(pages), dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = torch.tensor(order[start:start + p], dtype=torch.int32)
        start += p
    k, v = rand(num_pages, page, kh, h), rand(num_pages, page, kh, h)
    return k, v, {"block_table_BP": table, "seqused_k_B": torch.tensor(lk, dtype=torch.int32)}


def _dense_mask(lq, lk, g) -> torch.Tensor:
    """Block-diagonal random mask over packed tokens; every query keeps its run's last key."""
    cu_q, cu_k = _cu(lq), _cu(lk)
    mask = torch.zeros(cu_q[-1], cu_k[-1], dtype=torch.bool)
    for b in range(len(lq)):
        block = torch.rand(lq[b], lk[b], generator=g) < 0.5
        block[:, -1] = True
        mask[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = block
    return mask


def meta_to(meta: VarlenMeta, device) -> VarlenMeta:
    moved = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    return VarlenMeta(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


# ----------------------------------------------------------------- attention oracles


def naive_attention(spec: AttentionSpec, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
    """float64 einsum-softmax attention with every mask written out."""
    q, k, v = (t.detach().cpu().double() for t in (q_TNH, k, v))
    meta = meta_to(meta, "cpu")
    scale = spec.scale or 1.0 / math.sqrt(spec.head_dim)
    kv_head = torch.arange(spec.num_heads) // (spec.num_heads // spec.num_kv_heads)
    if spec.mask == "dense":
        return _softmax_attend(q, k[:, kv_head], v[:, kv_head], meta.mask_TS, scale)
    out = torch.zeros_like(q)
    cq, ck = meta.cu_seqlens_q_host, meta.cu_seqlens_k_host
    for b in range(len(cq) - 1):
        qb = q[cq[b]:cq[b + 1]]
        if spec.paged:
            n = int(meta.seqused_k_B[b])
            pages = [int(p) for p in meta.block_table_BP[b][: math.ceil(n / spec.page_size)]]
            kb = torch.cat([k[p] for p in pages])[:n]
            vb = torch.cat([v[p] for p in pages])[:n]
        else:
            kb, vb = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        lq, lk = qb.shape[0], kb.shape[0]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if spec.mask == "causal":  # query i (of lq) sees key j iff j <= i + (lk - lq)
            allowed = torch.tensor([[j <= i + (lk - lq) for j in range(lk)] for i in range(lq)])
        out[cq[b]:cq[b + 1]] = _softmax_attend(qb, kb[:, kv_head], vb[:, kv_head], allowed, scale)
    return out


def _softmax_attend(q_TNH, k_SNH, v_SNH, allowed_TS, scale) -> torch.Tensor:
    scores = torch.einsum("tnh,snh->nts", q_TNH, k_SNH) * scale
    scores = scores.masked_fill(~allowed_TS[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nts,snh->tnh", probs, v_SNH)


def reference_attention(spec: AttentionSpec, q_TNH, k, v, meta: VarlenMeta) -> torch.Tensor:
    """The reference kernel in float32 on the CPU."""
    ref = ReferenceAttention(dataclasses.replace(spec, dtype=torch.float32))
    return ref(q_TNH.cpu().float(), k.cpu().float(), v.cpu().float(), meta_to(meta, "cpu"))


# ----------------------------------------------------------------- GEMM oracles


def naive_fp8(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """Quantize to e4m3 with an absmax scale (fp32 arithmetic) and dequantize back to float64."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True) if per_row else x32.abs().amax()
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.double() * scale.double()


def naive_linear(spec: GemmSpec, x, w_OI, bias_O) -> torch.Tensor:
    x, w = x.detach().cpu().to(spec.dtype), w_OI.detach().cpu()
    if spec.quant != "none":
        per_row = spec.quant == "fp8_row"
        x, w = naive_fp8(x, per_row), naive_fp8(w, per_row)
    y = torch.einsum("...i,oi->...o", x.double(), w.double())
    return y if bias_O is None else y + bias_O.cpu().double()


def naive_grouped(spec: GroupedGemmSpec, x_TI, w_EOI, offsets_E) -> torch.Tensor:
    x, w = x_TI.detach().cpu().to(spec.dtype), w_EOI.detach().cpu()
    y = torch.zeros(x.shape[0], spec.out_features, dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets_E.cpu().tolist()):
        xe, we = x[start:end], w[e]
        if spec.quant != "none" and end > start:  # fp8_tensor: one scale per expert group of rows
            per_row = spec.quant == "fp8_row"
            xe, we = naive_fp8(xe, per_row), naive_fp8(we, per_row)
        y[start:end] = xe.double() @ we.double().T
        start = end
    return y


def naive_moe(spec: MoESpec, x_TD, w_Tk, ids_Tk, w13, w2, weight_fp64=None) -> torch.Tensor:
    """The routed experts in float64, one expert at a time: rows, weights and the SwiGLU output quantized as
    ``spec.quant`` says (per token / per row for fp8_row, per tensor for fp8_tensor), SiLU on the second half.
    ``weight_fp64``: an expert's ``[O, I]`` weight -> its float64 values, where the weights round otherwise."""
    x, w13, w2 = x_TD.cpu().to(spec.dtype), w13.cpu(), w2.cpu()
    ids, wts = ids_Tk.cpu(), w_Tk.cpu().double()
    out = torch.zeros(x.shape[0], spec.hidden, dtype=torch.float64)
    q, per_row = spec.quant != "none", spec.quant == "fp8_row"
    weight_fp64 = weight_fp64 or (lambda w: naive_fp8(w, per_row) if q else w.double())
    for e in range(spec.num_experts):
        t_idx, j_idx = (ids == e).nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            continue
        xe = naive_fp8(x[t_idx], per_row) if q else x[t_idx].double()
        h = xe @ weight_fp64(w13[e]).T
        a = h[:, :spec.inner] * F.silu(h[:, spec.inner:])
        a = naive_fp8(a.to(spec.dtype), per_row) if q else a
        out.index_add_(0, t_idx, (a @ weight_fp64(w2[e]).T) * wts[t_idx, j_idx][:, None])
    return out


def naive_block_moe(spec: MoESpec, x_TD, w_Tk, ids_Tk, w13, w2) -> torch.Tensor:
    """``naive_moe`` (fp8_row) for experts in 128x128 weight blocks (the cuda platform's ``deepgemm`` MoE): the
    weights through ``deepgemm_moe.block_quantize`` instead of row scales."""
    from omni.platforms.cuda.deepgemm_moe import block_dequantize, block_quantize

    def blocks(w_OI):
        return block_dequantize(block_quantize(w_OI.to(spec.dtype)[None]))[0].double()

    return naive_moe(spec, x_TD, w_Tk, ids_Tk, w13, w2, weight_fp64=blocks)


def check_padded_route(route, ids_Tk, num_experts: int, align: int) -> None:
    """A padded sort (the cuda platform's ``route_padded``, DeepGEMM's contiguous layout) from first principles:
    each assignment t*k + j sits in a row naming its token and expert; each expert's rows are consecutive, in
    assignment order, from an ``align``-aligned start after the earlier experts' blocks; every other row is padding
    (expert -1, token 0); the rows are the worst-case bound."""
    from omni.platforms.cuda.padded_route import padded_capacity

    ids = ids_Tk.reshape(-1).long().cpu()
    token_M, expert_M, inv = route.token_M.cpu(), route.expert_M.cpu(), route.inverse_R.cpu()
    R, k = ids.numel(), ids_Tk.shape[1]
    assert token_M.numel() == expert_M.numel() == padded_capacity(R, num_experts, align)
    assert expert_M.numel() % align == 0
    assert expert_M.dtype == torch.int32 and inv.numel() == R and inv.unique().numel() == R
    assert torch.equal(expert_M[inv].long(), ids) and torch.equal(token_M[inv], torch.arange(R) // k)
    padding = torch.ones(expert_M.numel(), dtype=torch.bool)
    padding[inv] = False
    assert (expert_M[padding] == -1).all() and (token_M[padding] == 0).all()
    start = 0
    for e in range(num_experts):
        rows = inv[ids == e]  # assignment order
        assert torch.equal(rows, torch.arange(start, start + rows.numel())), f"expert {e}'s rows"
        start += -(-rows.numel() // align) * align


def reference_linear(spec: GemmSpec, x, w_OI, bias_O) -> torch.Tensor:
    ref = ReferenceLinear(dataclasses.replace(spec, dtype=torch.float32))
    bias = None if bias_O is None else bias_O.cpu().float()
    return ref(x.cpu().float(), ref.prepare_weight(w_OI.cpu().float()), bias)


def reference_grouped(spec: GroupedGemmSpec, x_TI, w_EOI, offsets_E) -> torch.Tensor:
    ref = ReferenceGroupedGemm(dataclasses.replace(spec, dtype=torch.float32))
    return ref(x_TI.cpu().float(), ref.prepare_weight(w_EOI.cpu().float()), offsets_E.cpu())


def oracles(platform_name: str):
    """(attention, linear, grouped) oracle functions for a platform under test."""
    if platform_name == "cpu":
        return naive_attention, naive_linear, naive_grouped
    return reference_attention, reference_linear, reference_grouped
