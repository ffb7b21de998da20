"""The fused MoE of the CUDA platform (``omni_moe_impl``): routed experts in seven launches.

May assume: tensors live on the worker's CUDA device (the torch kernels also
run on CPU tensors, which the CPU tests use). Nothing here reads routing on
the host, so the whole layer is capturable.

    sort        stable counting sort of the T*k expert ids (Triton: one launch for a few rows, else counts per
                block, then places; ``route_launch.route_plan``); each sorted row's token, each assignment's
                sorted row, the group ends (no host read)
    gather      bf16: x[token_R];  fp8: gather + per-row e4m3 quantization in one pass (Triton), or, for
                rows a glue kernel quantized already (``RowQuantized``), a gather of the e4m3 rows and scales
    GEMM 1      torch._grouped_mm / our CUTLASS grouped fp8 kernel (kernels.grouped_fp8) or
                torch._scaled_grouped_mm over the expert groups -> h [R, 2I] bf16
    SwiGLU      x1 * silu(x2) (SiLU on the SECOND half), fused with the per-row e4m3 quantization (Triton);
                on our CUTLASS kernel (fp8_row) GEMM 1's epilogue computes it instead (a [R, I] bf16,
                half of h) and a quantization pass follows
    GEMM 2      as GEMM 1 -> y [R, D] bf16
    combine     out[t] = sum(addends)[t] + sum_j w[t, j] * y[row of (t, j)], fp32 accumulate, one pass (Triton);
                the model passes the shared expert's output and the residual as addends (``accepts_addends``)

The memory-bound steps run as Triton kernels (``moe_triton.py``) or as
torch ops computing the same function (``TorchKernels``), as the spec's
``memory_bound`` (``kernels.memory_bound``) says: ``auto`` takes Triton when
it imports, ``torch`` the torch ops, ``triton`` demands Triton (refused
where it does not import). Weights keep the grouped-GEMM layouts of
``gemm.py`` (``[E, O, I]`` e4m3 with ``[E, O, 1]`` fp32 row scales), so a
checkpoint's prepared experts are the same either way.
``fp8_tensor`` (one activation scale per expert group) quantizes after the
gather with the group scales of ``gemm.group_tensor_scales``; ``fp8_row`` is
the fast path.

The SwiGLU epilogue (``paired``, our CUTLASS build with ``swiglu``) needs
each output pair (x1_j, x2_j) in adjacent columns, so with it this MoE keeps
the prepared ``w13`` (data ``[E, 2I, D]`` and scales ``[E, 2I, 1]``) with its
rows in pairs: row 2j is the first half's row j, row 2j + 1 the second
half's (``pair_rows``). That is this kernel's documented layout
(``PreparedWeight``); only this MoE reads it. Its roundings differ from the
separate pass: x1 and x2 stay fp32 (no bf16 ``h``) and the product is
rounded to bf16 before the e4m3 quantization (docs/quality.md).
"""
from __future__ import annotations

import torch

from omni import quant
from omni.moe import add_terms, sort_by_expert, swiglu as torch_swiglu, weighted_sum
from omni.specs import GroupedGemmSpec, MoESpec, PreparedMoE, PreparedWeight, RowQuantized

from .capabilities import Caps, runs_triton, triton_found
from .cutlass_grouped import BySize
from .gemm import LATER, GroupedMM, ScaledGroupedMM, _later, fast_accum_tag, fp8_grouped_choice, grouped_swiglu_kernel
from .padded_route import torch_route_padded
from .triton_compile import compiling

FP8 = ("fp8_row", "fp8_tensor")


def torch_route_rows(ids_Tk: torch.Tensor, num_experts: int):
    """``(token_R, inverse_R, offsets_E)``: the stable sort by expert (``omni.moe.sort_by_expert``) as the MoE
    uses it: each sorted row's token, each assignment's sorted row, the int32 group ends."""
    routing = sort_by_expert(ids_Tk, num_experts)
    return routing.token_R, routing.inverse(), routing.offsets_E


class TorchKernels:
    """The memory-bound steps as plain torch ops (the Triton kernels' definition)."""

    name = "torch"
    route_rows = staticmethod(torch_route_rows)
    route_padded = staticmethod(torch_route_padded)

    def quant_gather(self, x_TD, token_R, expert_R=None):
        """``expert_R`` (the padded layout's, ``padded_route``): the Triton kernel leaves its padding rows
        unwritten; here they hold token 0's row (``token_R`` names it), which is as good: nobody reads them."""
        xq, s = quant.quantize_fp8(x_TD, per_row=True)  # per-token scales commute with the gather
        return xq[token_R], s[token_R]

    def quant_rows(self, x_TD):
        return quant.quantize_fp8(x_TD, per_row=True)

    def scatter_rows(self, q_TD, s_T1, inverse_R, rows=None):
        """``out[inverse_R[t*k + j]] = q[t]``: the rows by sorted row, the inverse permutation's token each;
        ``rows`` (the padded layout's count): the rows no assignment names hold token 0's row."""
        R, T = inverse_R.numel(), q_TD.shape[0]
        token_R = torch.zeros(rows or R, dtype=inverse_R.dtype, device=inverse_R.device)
        token_R[inverse_R] = torch.arange(R, device=inverse_R.device) // (R // T if T else 1)
        return q_TD[token_R], s_T1.reshape(-1, 1).float()[token_R]

    def swiglu(self, h_R2I, quantize: bool, expert_R=None):
        """``expert_R``: as ``quant_gather``'s (every row is computed here)."""
        a = torch_swiglu(h_R2I)
        return quant.quantize_fp8(a, per_row=True) if quantize else (a, None)

    def combine(self, y_RD, inverse_R, w_Tk, dtype, addends: tuple = ()):
        return add_terms(weighted_sum(y_RD, inverse_R, w_Tk), addends).to(dtype)

    def skinny_fp8(self, max_rows: int):
        """No few-row dense fp8 kernel among the torch ops: cuBLAS keeps every row count."""
        return None

    def grouped_skinny_fp8(self, max_rows: int, swiglu: bool):
        """No few-row grouped fp8 kernel among the torch ops: the grouped kernel keeps every row count."""
        return None


def joined(addends) -> tuple:
    """The combine's addends: a tuple, or what the callable (``omni_moe_impl``'s side-stream join) returns, called
    here, right before the combine, so the shared expert's stream overlaps the routed GEMMs."""
    return addends() if callable(addends) else addends


def memory_kernels(choice: str, reject, pdl_rows: int = 0, sm: tuple[int, int] = (0, 0)):
    """The memory-bound kernels ``spec.memory_bound`` asks for; None after ``reject`` when a demand cannot be met.
    The Triton kernels launch calls of at most ``pdl_rows`` rows with PDL where device ``sm`` has it (``pdl``)."""
    use = runs_triton(choice, triton_found(), reject, "cuda: kernels.memory_bound=triton, but triton does not "
                      "import here (install it, or set kernels.memory_bound: auto | torch)")
    if not use:
        return None if use is None else TorchKernels()
    from .moe_triton import TritonKernels  # imports triton: only once it is known to be there
    from .pdl import Pdl

    return TritonKernels(Pdl.on_device(pdl_rows, sm))


def pair_rows(w: PreparedWeight) -> PreparedWeight:
    """``[E, 2I, ...]`` rows in halves -> in (first half's j, second half's j) pairs, scales alike."""
    half = w.data.shape[1] // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1).to(w.data.device)
    return PreparedWeight(w.data.index_select(1, order), w.scale.index_select(1, order.to(w.scale.device)))


class CudaMoE:
    """Routed experts over ``torch._grouped_mm`` or the fp8 grouped kernel ``resolve_moe`` chose (module docstring);
    ``paired``: our CUTLASS build with the SwiGLU epilogue (``fp8_row`` only), which pairs ``w13``'s rows."""

    def __init__(self, spec: MoESpec, kernels, grouped_kernel=None, paired=None):
        self.spec, self.kernels, self.paired = spec, kernels, paired
        self.accepts_row_quantized = spec.quant == "fp8_row"  # rows the glue quantized: gathered, not requantized
        self.accepts_addends = True  # the combine kernel adds the shared expert and the residual (no extra pass)
        kw = dict(num_experts=spec.num_experts, dtype=spec.dtype, quant=spec.quant, fast_accum=spec.fast_accum,
                  grouped_fp8=spec.grouped_fp8, small_rows=spec.small_rows)
        g13 = GroupedGemmSpec(in_features=spec.hidden, out_features=2 * spec.inner, **kw)
        g2 = GroupedGemmSpec(in_features=spec.inner, out_features=spec.hidden, **kw)
        if spec.quant in FP8:  # both expert GEMMs on one kernel: ours (grouped_kernel) or torch's (None)
            # with the SwiGLU epilogue, GEMM 1 runs that build (its output: a = x1 * silu(x2), [R, I])
            self.gemm13 = ScaledGroupedMM(g13, paired or grouped_kernel)
            self.gemm2 = ScaledGroupedMM(g2, grouped_kernel)
        else:
            self.gemm13, self.gemm2 = GroupedMM(g13), GroupedMM(g2)
        fast = fast_accum_tag(spec) if spec.quant in FP8 else ""
        impl = f",{grouped_kernel.config}" if grouped_kernel is not None else ""
        epi = f",swiglu-epilogue[{paired.config}]" if paired is not None else ""  # its own tiles (cutlass_grouped)
        self.name = f"cuda-fused-moe[{spec.quant},{self.kernels.name}{fast}{impl}{epi}]"

    def prepare_weights(self, w13_EOI: torch.Tensor, w2_EOI: torch.Tensor) -> PreparedMoE:
        return self._layout(self.gemm13.prepare_weight(w13_EOI), self.gemm2.prepare_weight(w2_EOI))

    def prepare_quantized_weights(self, w13: PreparedWeight, w2: PreparedWeight) -> PreparedMoE:
        """Pre-quantized e4m3 experts (reference scale layouts) -> this kernel's row-scale layout."""
        return self._layout(ScaledGroupedMM.prepare_quantized(w13), ScaledGroupedMM.prepare_quantized(w2))

    def _layout(self, w13: PreparedWeight, w2: PreparedWeight) -> PreparedMoE:
        return PreparedMoE(pair_rows(w13) if self.paired is not None else w13, w2)

    def __call__(self, x_TD, topk_weights_Tk, topk_ids_Tk, prepared: PreparedMoE, addends=()) -> torch.Tensor:
        """``x_TD``: rows, or (``fp8_row``) their ``RowQuantized`` form, whose e4m3 rows are gathered as they are;
        ``addends``: up to two ``[T, D]`` terms the combine adds in fp32 (``accepts_addends``), or a callable
        returning them, called right before the combine (the shared expert's side-stream join)."""
        token_R, inverse_R, offs = self.kernels.route_rows(topk_ids_Tk, prepared.w13.data.shape[0])
        rows = x_TD if isinstance(x_TD, RowQuantized) else None  # only fp8_row accepts them (accepts_row_quantized)
        out_dtype = self.spec.dtype if rows is not None else x_TD.dtype
        x = None if rows is not None else x_TD.to(self.spec.dtype)
        if self.spec.quant == "fp8_row":
            xq, xs = (self.kernels.scatter_rows(rows.q_TI, rows.scale_T1, inverse_R) if rows is not None
                      else self.kernels.quant_gather(x, token_R))
            most = topk_ids_Tk.shape[0]  # no expert gets more rows than tokens: a token's k experts are distinct
            h = self.gemm13.scaled(xq, xs, prepared.w13, offs, most)  # with the epilogue: the SwiGLU already
            aq, as_ = self.kernels.quant_rows(h) if self.paired is not None else self.kernels.swiglu(h, quantize=True)
            y = self.gemm2.scaled(aq, as_, prepared.w2, offs, most)
        elif self.spec.quant == "fp8_tensor":
            h = self.gemm13.group_quantized(x[token_R], prepared.w13, offs)
            y = self.gemm2.group_quantized(self.kernels.swiglu(h, quantize=False)[0], prepared.w2, offs)
        else:  # GroupedMM
            h = self.gemm13(x[token_R], prepared.w13, offs)
            y = self.gemm2(self.kernels.swiglu(h, quantize=False)[0], prepared.w2, offs)
        return self.kernels.combine(y, inverse_R, topk_weights_Tk, out_dtype, joined(addends))


def resolve_moe(spec: MoESpec, caps: Caps, reject):
    """The fused MoE when both grouped GEMMs of ``spec`` resolve here; each refusal says why."""
    if spec.quant in LATER:
        return reject(_later(spec.quant, caps))
    if spec.dtype != torch.bfloat16:
        return reject(f"cuda-moe: the grouped GEMM kernels write bf16 only, spec.dtype is {spec.dtype}")
    if spec.grouped_fp8 == "deepgemm" and spec.quant != "none":
        return _deepgemm(spec, caps, reject)
    grouped_kernel = None
    if spec.quant in FP8:
        if spec.hidden % 16 or spec.inner % 16:
            return reject(f"cuda-moe: fp8 grouped GEMMs need hidden and inner divisible by 16, "
                          f"got {spec.hidden}/{spec.inner}")
        grouped_kernel, refusal = fp8_grouped_choice(spec, caps, "cuda-moe")
        if refusal:
            return reject(refusal)
    else:
        if not caps.has_grouped_mm or caps.sm < (8, 0):
            return reject(f"cuda-moe: torch._grouped_mm needs a torch that has it and sm80+ ({caps.sm_name})")
        if spec.hidden % 8 or spec.inner % 8:
            return reject(f"cuda-moe: torch._grouped_mm needs 16-byte aligned rows, got {spec.hidden}/{spec.inner}")
    kernels = memory_kernels(spec.memory_bound, reject, spec.pdl_rows, caps.sm)
    if kernels is None:
        return None
    paired = grouped_swiglu_kernel(spec, caps) if grouped_kernel is not None and spec.quant == "fp8_row" else None
    gemm, paired = with_few_rows(grouped_kernel, spec, kernels), with_few_rows(paired, spec, kernels)
    if torch.cuda.is_available():
        compile_at_build(spec, kernels, gemm, paired)
    return CudaMoE(spec, kernels, gemm, paired)


def _deepgemm(spec: MoESpec, caps: Caps, reject):
    """The MoE on DeepGEMM's grouped kernel (``deepgemm_moe``), with this platform's memory-bound kernels."""
    from .deepgemm_moe import resolve_deepgemm_moe

    kernels = memory_kernels(spec.memory_bound, reject, spec.pdl_rows, caps.sm)
    moe = None if kernels is None else resolve_deepgemm_moe(spec, caps.sm, kernels, reject)
    if moe is not None and torch.cuda.is_available():
        compile_at_build(spec, kernels, align=moe.align)
    return moe


def compile_at_build(spec: MoESpec, kernels, *gemms, align: int = 1) -> None:
    """Every binary the sort (``compile_routes``) and the few-row grouped GEMMs (``compile_rows``) can launch,
    compiled now, together on the compile pool (one ``compiling()`` scope), not in the first request of each row
    class: the sort's classes cost a 17-token prompt 1.1 s of its prefill on the H200, the few-row GEMM's two
    binaries the first prompt of at most 16 tokens (BENCHMARKS.md, "Twenty-ninth" and "Thirty-fifth session").
    ``align``: the sort's padded layout (the DeepGEMM MoE's), whose alignment is a constant of its binaries."""
    with compiling():  # nothing runs inside: only compiles
        if hasattr(kernels, "compile_routes"):
            kernels.compile_routes(spec.num_experts, spec.topk, align)
        for gemm in gemms:
            few = getattr(gemm, "small", None)  # with_few_rows puts the few-row kernel in front
            if hasattr(few, "compile_rows"):
                few.compile_rows(spec.num_experts)


def with_few_rows(kernel, spec: MoESpec, kernels):
    """Our CUTLASS ``kernel`` with the memory-bound kernels' grouped GEMM for a decode step's few rows per expert
    in front (``grouped_skinny_triton``: groups of up to ``spec.skinny_rows`` rows and its measured tiles' limit;
    ``__call__`` bounds the groups by the tokens), for ``fp8_row`` with fast accumulation (where it was measured);
    ``kernel`` alone otherwise (no Triton, torch's grouped kernel, exact accumulation, ``skinny_rows`` 0)."""
    if kernel is None or spec.quant != "fp8_row" or not spec.fast_accum or not spec.skinny_rows:
        return kernel
    few = kernels.grouped_skinny_fp8(spec.skinny_rows, kernel.swiglu)
    return kernel if few is None else BySize(kernel, few, few.max_rows)
