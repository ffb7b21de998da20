"""Dense and grouped (MoE) GEMMs of the CUDA platform, plain and FP8.

May assume: weights and activations live on the worker's CUDA device. The
quantization math is ``omni.quant``'s (e4m3, absmax scales, dynamic
activations), so a prepared weight here dequantizes exactly as the
reference's does; only the product runs on tensor cores.

Layouts: ``PreparedWeight.data`` stays ``[O, I]`` / ``[E, O, I]`` row-major
(the documented layout); ``torch._scaled_mm`` and the grouped kernels get the
free transposed view (``[I, O]`` column-major) they require. Grouped FP8
weights keep one scale per output row, ``[E, O, 1]`` (a per-expert tensor
scale is broadcast once at load), since ``_scaled_grouped_mm`` is row-wise.
Every ``__call__`` is capturable: no host reads of ``offsets_E``.
"""
from __future__ import annotations

import functools
import subprocess

import torch
import torch.nn.functional as F

from omni import quant
from omni.specs import GemmSpec, GroupedGemmSpec, PreparedWeight, RowQuantized

from .capabilities import Caps, log_once
from .cutlass_grouped import BySize, config_of, load, prebuild


FP8_SCHEMES = ("fp8_tensor", "fp8_row")
LATER = {
    "mxfp8": "mxfp8 needs sm100 block-scaled kernels (e8m0 scales); lands later",
    "nvfp4": "nvfp4 needs sm100 fp4 kernels; lands later",
    "w8a8": "w8a8 int8 kernels land later",
}
BLOCK_SCALED = ("mxfp8", "nvfp4")  # need compute capability 10.0 (Blackwell block-scaled tensor cores)


def block_scaled_refusal(scheme: str, sm: tuple[int, int]) -> str | None:
    """Why ``quant.scheme=scheme`` cannot run on a device of compute capability ``sm``; None when it can."""
    if scheme not in BLOCK_SCALED:
        return None
    if sm < (10, 0):
        return (f"quant.scheme={scheme} needs compute capability 10.0 (sm100 block-scaled tensor cores); "
                f"this device is sm{sm[0]}{sm[1]}: use quant.scheme=fp8_row")
    return f"quant.scheme={scheme}: {LATER[scheme]}"


def _later(scheme: str, caps: Caps) -> str:
    return "cuda: " + (block_scaled_refusal(scheme, caps.sm) or f"quant.scheme={scheme}: {LATER[scheme]}")


def _dims(spec) -> str:
    return f"{spec.in_features}x{spec.out_features}"


def fast_accum_tag(spec) -> str:
    """The kernel-name suffix that says ``spec.fast_accum`` is on."""
    return ",fast-accum" if spec.fast_accum else ""


def _unwrap(y):
    return y[0] if isinstance(y, tuple) else y  # torch < 2.4 returned (out, amax)


# ----------------------------------------------------------------- dense


class CudaLinear:
    name = "cuda-linear"

    def __init__(self, spec: GemmSpec):
        self.dtype = spec.dtype

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight:
        return PreparedWeight(w_OI)

    def __call__(self, x_TI, w: PreparedWeight, bias_O=None) -> torch.Tensor:
        return F.linear(x_TI.to(self.dtype), w.data, bias_O)


class SplitFp32Linear:
    """An fp32 linear (the MoE router) fed bf16 rows, on bf16 tensor cores, within 4.4e-6 of the fp32 product.

    ``prepare_weight`` splits the fp32 ``[O, I]`` weight into three bf16
    parts stacked as ``data`` ``[3O, I]`` (hi, mid, lo: each the bf16 rounding
    of what the parts before it left, so ``hi + mid + lo`` is the weight to
    within 2^-27 of its value, below fp32's own rounding). A bf16 row times a
    bf16 part is exact in fp32, so one bf16 GEMM with an fp32 output
    (``aten::mm.dtype``) and a sum over the three parts gives the fp32 product
    but for the tensor cores' fp32 accumulation, which aligns addends with
    truncation: 4.4e-6 relative on an H200 against 4.1e-7 for torch's fp32
    GEMM (a bf16 router would be ~2e-3; tests/gpu/test_gpu_fp8_linear.py
    also checks the top-8 experts agree). It replaces the fp32 copy of the
    rows and the fp32 GEMM: 48 us against 212 us per layer at 8194 x 4096 ->
    64 (bench/bench_glue.py).
    Rows of other dtypes take the fp32 product of the recombined weight.
    """

    name = "cuda-linear[fp32 as 3 x bf16]"

    def __init__(self, spec: GemmSpec):
        self.spec = spec

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight:
        rest = w_OI.float()
        parts = []
        for _ in range(3):  # hi, mid, lo
            parts.append(rest.to(torch.bfloat16))
            rest = rest - parts[-1].float()
        return PreparedWeight(torch.cat(parts))

    def fp32_weight(self, w: PreparedWeight) -> torch.Tensor:
        """The ``[O, I]`` fp32 weight, prepared (``hi + mid + lo``) or not."""
        if w.data.dtype != torch.bfloat16:
            return w.data.float()
        return w.data.float().view(3, self.spec.out_features, -1).sum(0)

    def __call__(self, x_TI, w: PreparedWeight, bias_O=None) -> torch.Tensor:
        O = self.spec.out_features
        lead, x = x_TI.shape[:-1], x_TI.reshape(-1, self.spec.in_features)
        if x.dtype != torch.bfloat16 or w.data.dtype != torch.bfloat16:  # other rows, or not prepared yet
            y = F.linear(x.float(), self.fp32_weight(w))
        else:
            y = torch.mm(x, w.data.t(), out_dtype=torch.float32).view(-1, 3, O).sum(1)
        y = y.view(*lead, O)
        return y if bias_O is None else y + bias_O


class Fp8Linear:
    """``torch._scaled_mm`` with e4m3 weights and dynamic per-tensor / per-token activations.

    ``skinny``: with ``fp8_row``, fast accumulation and Triton, calls of at most ``spec.skinny_rows`` rows (a
    decode step's; the row count is a shape, so a captured call keeps its choice) and no bias run the Triton
    kernel for few rows (``skinny_triton``), which reads the weight on every SM where cuBLAS's 128-row tiles
    occupy a third of them (1.36-1.76x at 1-64 rows on the H200, BENCHMARKS.md "Sixteenth session").
    """

    def __init__(self, spec: GemmSpec, caps: Caps, kernels):
        self.spec, self.per_row, self.kernels = spec, spec.quant == "fp8_row", kernels
        fast = fast_accum_tag(spec)
        few = self.per_row and spec.fast_accum and spec.skinny_rows > 0
        self.skinny = kernels.skinny_fp8(spec.skinny_rows) if few else None
        rows = f",{self.skinny.name}" if self.skinny is not None else ""
        self.name = f"cuda-scaled-mm[{spec.quant},{kernels.name}{fast}{rows}]" if self.per_row else \
            f"cuda-scaled-mm[{spec.quant}{fast}]"
        # row-wise on other than sm90 + cuBLAS >= 12.9 runs a CUTLASS kernel that writes bf16 only
        any_out = not self.per_row or (caps.sm[0] == 9 and caps.cuda_version >= (12, 9))
        self.out_dtype = spec.dtype if any_out else torch.bfloat16
        self.fuse_bias = self.out_dtype in (torch.bfloat16, torch.float16)
        self.accepts_row_quantized = self.per_row  # rows quantized by the fused glue skip quant_rows
        if self.skinny is not None and torch.cuda.is_available():
            self.skinny.compile_rows(self.out_dtype)  # every row class's binary now, not in a request

    def prepare_weight(self, w_OI: torch.Tensor) -> PreparedWeight:
        return quant.prepare_weight(w_OI.contiguous(), self.spec.quant)

    def __call__(self, x_TI, w: PreparedWeight, bias_O=None) -> torch.Tensor:
        if isinstance(x_TI, RowQuantized):  # quantized already, by the norm or SwiGLU that made the rows
            lead, xq, x_scale = x_TI.q_TI.shape[:-1], x_TI.q_TI.reshape(-1, self.spec.in_features), x_TI.scale_T1
        else:
            lead, xq, x_scale = self._quantize(x_TI)
        w_scale = w.scale.view(1, -1) if self.per_row else w.scale
        if self.skinny is not None and bias_O is None and self.skinny.fits(xq):
            y = self.skinny(xq, x_scale, w.data, w_scale, out_dtype=self.out_dtype).to(self.spec.dtype)
        else:
            y = self._scaled_mm(xq, x_scale, w.data, w_scale, bias_O)
        return y.reshape(*lead, self.spec.out_features)

    def _scaled_mm(self, xq, x_scale, wq, w_scale, bias_O) -> torch.Tensor:
        bias = bias_O.to(self.out_dtype) if bias_O is not None and self.fuse_bias else None
        y = _unwrap(torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, bias=bias,
                                     out_dtype=self.out_dtype, use_fast_accum=self.spec.fast_accum)).to(self.spec.dtype)
        return y + bias_O if bias_O is not None and bias is None else y

    def _quantize(self, x_TI):
        lead, x = x_TI.shape[:-1], x_TI.reshape(-1, self.spec.in_features).to(self.spec.dtype)
        if self.per_row and x.is_cuda:  # the memory-bound kernels: with Triton, one pass instead of five torch ops
            return (lead, *self.kernels.quant_rows(x))
        return (lead, *quant.quantize_fp8(x, per_row=self.per_row))


def resolve_linear(spec: GemmSpec, caps: Caps, reject):
    from .moe import memory_kernels  # moe.py builds on this module's grouped GEMMs

    kernels = memory_kernels(spec.memory_bound, reject, spec.pdl_rows, caps.sm)
    if kernels is None:
        return None
    if spec.quant == "none":
        split = spec.dtype == torch.float32 and caps.has_mm_out_dtype and caps.sm >= (8, 0)
        return SplitFp32Linear(spec) if split else CudaLinear(spec)
    if spec.quant in LATER:
        return reject(_later(spec.quant, caps))
    if not caps.has_scaled_mm:
        return reject("cuda: torch._scaled_mm is not in this torch")
    if caps.sm < (8, 9):
        return reject(f"cuda: {spec.quant} needs compute capability >= 8.9 (fp8 tensor cores), not {caps.sm_name}")
    if spec.in_features % 16 or spec.out_features % 16:
        return reject(f"cuda: torch._scaled_mm needs features divisible by 16, got {_dims(spec)}")
    return Fp8Linear(spec, caps, kernels)


# ----------------------------------------------------------------- grouped


class GroupedMM:
    """``torch._grouped_mm`` (bf16) over expert-sorted rows with int32 cumulative offsets."""

    name = "cuda-grouped-mm"

    def __init__(self, spec: GroupedGemmSpec):
        self.spec = spec

    def prepare_weight(self, w_EOI: torch.Tensor) -> PreparedWeight:
        return PreparedWeight(w_EOI.contiguous())

    def __call__(self, x_TI, w: PreparedWeight, offsets_E) -> torch.Tensor:
        x = x_TI.to(torch.bfloat16).contiguous()
        return torch._grouped_mm(x, w.data.transpose(-2, -1), offs=offsets_E.to(torch.int32), out_dtype=torch.bfloat16)


def group_tensor_scales(x_TI: torch.Tensor, offsets_E: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-row fp32 scales ``[T, 1]`` equal to the absmax scale of each row's expert group (no host sync)."""
    rows = torch.arange(x_TI.shape[0], device=x_TI.device, dtype=offsets_E.dtype)
    expert = torch.searchsorted(offsets_E, rows, right=True).clamp_max(num_experts - 1).long()
    row_amax = x_TI.abs().amax(dim=-1).float()
    group_amax = row_amax.new_zeros(num_experts).scatter_reduce(0, expert, row_amax, "amax")
    return (group_amax / quant.FP8_MAX).clamp_min(1e-12)[expert][:, None]


class ScaledGroupedMM:
    """e4m3 rows x e4m3 experts, row-wise scales, bf16 out: our CUTLASS build or ``torch._scaled_grouped_mm``.

    ``kernel`` is our CUTLASS build (``cutlass_grouped``, ``kernels.grouped_fp8``)
    or None for torch's kernel; both take the same operands and give the same
    bits at these shapes. ``spec.fast_accum`` selects fast accumulation: in
    torch's kernel ``use_fast_accum`` (256x128 tiles that accumulate in the
    tensor cores, instead of 128x128 tiles that promote partial sums to fp32
    every K block), in ours its fast configuration.
    """

    def __init__(self, spec: GroupedGemmSpec, kernel=None):
        self.spec, self.per_row, self.kernel = spec, spec.quant == "fp8_row", kernel
        impl = f",{kernel.config}" if kernel is not None else ""
        self.name = f"cuda-scaled-grouped-mm[{spec.quant}{fast_accum_tag(spec)}{impl}]"

    def prepare_weight(self, w_EOI: torch.Tensor) -> PreparedWeight:
        p = quant.prepare_weight(w_EOI.contiguous(), self.spec.quant)
        e, o, _ = w_EOI.shape
        return PreparedWeight(p.data, p.scale.expand(e, o, 1).contiguous())

    @staticmethod
    def prepare_quantized(w: PreparedWeight) -> PreparedWeight:
        """A checkpoint's e4m3 experts with ``[E, 1, 1]`` or ``[E, O, 1]`` scales -> row scales ``[E, O, 1]``."""
        e, o, _ = w.data.shape
        return PreparedWeight(w.data.contiguous(), w.scale.float().reshape(e, -1, 1).expand(e, o, 1).contiguous())

    def __call__(self, x_TI, w: PreparedWeight, offsets_E) -> torch.Tensor:
        x, offs = x_TI.to(self.spec.dtype), offsets_E.to(torch.int32)
        if self.per_row:
            return self.scaled(*quant.quantize_fp8(x, per_row=True), w, offs)
        return self.group_quantized(x, w, offs)

    def scaled(self, xq_RI, xs_R1, w: PreparedWeight, offs_E, group_rows: int | None = None) -> torch.Tensor:
        """e4m3 rows with their ``[R, 1]`` scales times the prepared experts, bf16 ``[R, O]`` (``[R, O / 2]``
        when ``kernel`` is our build with the SwiGLU epilogue, which the cuda MoE gives its GEMM 1);
        ``group_rows``: a bound on any group's rows (the MoE's token count), for kernels that size tiles by it."""
        e, o = w.data.shape[:2]
        if self.kernel is not None:
            return self.kernel(xq_RI.contiguous(), xs_R1.reshape(-1).float().contiguous(), w.data,
                               w.scale.view(e, o), offs_E.to(torch.int32).contiguous(), group_rows=group_rows)
        return torch._scaled_grouped_mm(xq_RI, w.data.transpose(-2, -1), xs_R1.reshape(-1), w.scale.view(e, o),
                                        offs=offs_E, out_dtype=torch.bfloat16, use_fast_accum=self.spec.fast_accum)

    def group_quantized(self, x_RI, w: PreparedWeight, offs_E) -> torch.Tensor:
        """Reference semantics of ``fp8_tensor``: one activation scale per expert group."""
        scale = group_tensor_scales(x_RI, offs_E, w.data.shape[0])
        xq = (x_RI.float() / scale).clamp(-quant.FP8_MAX, quant.FP8_MAX).to(torch.float8_e4m3fn)
        return self.scaled(xq, scale, w, offs_E)


def resolve_grouped(spec: GroupedGemmSpec, caps: Caps, reject):
    if spec.quant in LATER:
        return reject(_later(spec.quant, caps))
    if spec.dtype != torch.bfloat16:
        return reject(f"cuda: grouped GEMM kernels write bf16 only, spec.dtype is {spec.dtype}")
    if spec.quant == "none":
        return _grouped_bf16(spec, caps, reject)
    return _grouped_fp8(spec, caps, reject)


def _grouped_bf16(spec: GroupedGemmSpec, caps: Caps, reject):
    if not caps.has_grouped_mm or caps.sm < (8, 0):
        return reject(f"cuda: torch._grouped_mm needs a torch that has it and sm80+ ({caps.sm_name})")
    if spec.in_features % 8 or spec.out_features % 8:
        return reject(f"cuda: torch._grouped_mm needs 16-byte aligned rows (features % 8), got {_dims(spec)}")
    return GroupedMM(spec)


def _grouped_fp8(spec: GroupedGemmSpec, caps: Caps, reject):
    if spec.in_features % 16 or spec.out_features % 16:
        return reject(f"cuda: fp8 grouped GEMMs need features divisible by 16, got {_dims(spec)}")
    kernel, refusal = fp8_grouped_choice(spec, caps, "cuda")
    return reject(refusal) if refusal else ScaledGroupedMM(spec, kernel)


def fp8_grouped_choice(spec, caps: Caps, who: str):
    """``(kernel, None)``: our CUTLASS kernel, or None for torch's; ``(None, reason)`` when neither can serve."""
    kernel = grouped_fp8_kernel(spec, caps)
    if not isinstance(kernel, str):
        return kernel, None
    if spec.grouped_fp8 == "cutlass":
        return None, f"{who}: kernels.grouped_fp8=cutlass: {kernel}"
    if not caps.has_scaled_grouped_mm:
        return None, f"{who}: torch._scaled_grouped_mm is not in this torch"
    if caps.sm not in ((9, 0), (10, 0)):
        return None, f"{who}: torch._scaled_grouped_mm runs on sm90/sm100 only, not {caps.sm_name}"
    return None, None


def grouped_fp8_kernel(spec, caps: Caps):
    """Our CUTLASS grouped kernel for ``spec`` (a ``GroupedGemmSpec`` or ``MoESpec``), or why not (a string).

    ``kernels.grouped_fp8``: ``torch`` asks for none; ``auto`` and ``cutlass``
    build it where ``caps`` allow (sm90, nvcc, CUTLASS's headers). ``auto``
    falls back to torch's kernel, logging the reason; the caller refuses a
    ``cutlass`` demand with it.
    """
    if spec.grouped_fp8 == "torch":
        return "kernels.grouped_fp8=torch"
    # deepgemm: DeepGEMM serves the fused MoE (deepgemm_moe.py); the expert weights' holders (GroupedLinear)
    # still resolve a lone grouped GEMM, which takes auto's choice
    reason = caps.cutlass_grouped_refusal
    if reason is None:
        _prebuild(spec.fast_accum, caps.nvcc, caps.cutlass_include, bool(spec.small_rows))
        kernel = _load_cutlass(spec.fast_accum, caps.nvcc, caps.cutlass_include)
        if not isinstance(kernel, str):
            return with_small_tile(kernel, spec, caps)
        reason = kernel
    if spec.grouped_fp8 in ("auto", "deepgemm"):
        log_once(f"cuda: fp8 grouped GEMMs run torch._scaled_grouped_mm: {reason}")
    return reason


def grouped_swiglu_kernel(spec, caps: Caps):
    """Our CUTLASS grouped kernel with the SwiGLU epilogue for the MoE ``spec`` (``fp8_row`` on our kernel), or
    None: a build that fails costs only the fusion (logged once), the MoE then runs its separate SwiGLU pass."""
    _prebuild(spec.fast_accum, caps.nvcc, caps.cutlass_include, bool(spec.small_rows))
    kernel = _load_cutlass(spec.fast_accum, caps.nvcc, caps.cutlass_include, True)
    if isinstance(kernel, str):
        log_once(f"cuda-moe: the SwiGLU epilogue is off, the MoE runs a separate SwiGLU pass: {kernel}")
        return None
    return with_small_tile(kernel, spec, caps, swiglu=True)


def with_small_tile(kernel, spec, caps: Caps, swiglu: bool = False):
    """``kernel`` with its small-tile build for few rows per expert (``spec.small_rows``, ``cutlass_grouped.BySize``),
    or alone where the spec turns it off, no such build exists (exact accumulation) or building it failed (logged)."""
    if not spec.small_rows or config_of(spec.fast_accum, swiglu, small=True) is None:
        return kernel
    small = _load_cutlass(spec.fast_accum, caps.nvcc, caps.cutlass_include, swiglu, small=True)
    if isinstance(small, str):
        log_once(f"cuda: every grouped fp8 call runs {kernel.config}; the small-tile build is off: {small}")
        return kernel
    return BySize(kernel, small, spec.small_rows)


@functools.lru_cache(maxsize=None)
def _load_cutlass(fast_accum: bool, nvcc: str, include: str, swiglu: bool = False, small: bool = False):
    """One build and one ctypes load per process and configuration; a failure is kept as its reason (no retry).
    Callers run ``_prebuild`` first, so the objects a recipe needs compile side by side."""
    try:
        return load(fast_accum, nvcc, include, swiglu=swiglu, small=small)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as err:
        return f"building or loading it failed: {type(err).__name__}: {err}"


@functools.lru_cache(maxsize=None)
def _prebuild(fast_accum: bool, nvcc: str, include: str, small_tiles: bool) -> None:
    """Once per process and choice: the objects a recipe may load, compiled and self-tested side by side (plain
    and SwiGLU epilogue; their small-tile builds only where the recipe's ``kernels.grouped_fp8_small_rows`` is
    not 0)."""
    prebuild(prebuild_configs(fast_accum, small_tiles), nvcc, include, device=torch.cuda.current_device())


def prebuild_configs(fast_accum: bool, small_tiles: bool) -> list:
    """The configurations ``_prebuild`` compiles: no small tiles without ``small_tiles`` (nor with exact
    accumulation, which has no small build)."""
    smalls = (False, True) if small_tiles else (False,)
    configs = [config_of(fast_accum, swiglu, small) for swiglu in (False, True) for small in smalls]
    return [c for c in configs if c is not None]
