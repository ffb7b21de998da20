"""The fused MoE on DeepGEMM's grouped fp8 GEMM (``kernels.grouped_fp8: deepgemm``, the ``cuda-deepgemm`` extra).

DeepGEMM (SGLang's binary ``sgl-deep-gemm`` wheel; its kernels are JIT-compiled on first use and cached on disk
by DeepGEMM) measured 1.15-1.26x our CUTLASS build on the routed split on an H100 (BENCHMARKS.md, "Forty-third
session"). Inside the served layer on an H100 that shrank to 0.26 ms a layer. The SwiGLU pass its GEMM cannot fuse,
the padded plan's torch ops and the padded gather cost as much, so the step was 1.02x slower ("Forty-fourth
session"). The plan and the gather are now the sort's and the scatter's own kernels (``padded_route``); on another
H100 the step still ran 1.07x slower (its gate_up 2.79 ms against our epilogue build's 2.59, its SwiGLU pass 0.43:
"Forty-fifth session"), and the choice stays opt-in. Its sm90 grouped GEMM takes its own formulation:

- the contiguous layout: every expert's rows start at a multiple of ``align`` rows (128); a row table names each
  padded row's expert, -1 for padding. Its scheduler skips blocks whose first row is padding, so the layout can
  be sized for the worst case (``padded_capacity``) and nothing is read on the host: the layer stays capturable;
- activation scales per row and 128-wide K block, in its MN-major layout; weight scales per 128x128 block;
- exact accumulation: partial sums promoted into fp32 every 128-wide K block (sm90 has no fast mode, so
  ``kernels.fp8_fast_accum`` changes nothing here).

Everything else is ``CudaMoE``'s fp8_row path: the same sort (``route_padded``: its places rounded up per
expert), gather + per-row quantization, SwiGLU + quantization and combine kernels, the padding rows skipped
(left unwritten: the GEMM's products of theirs are never read). Activations keep the
per-row scales of ``fp8_row`` (one scale repeated over the K blocks), so only the expert weights' scales differ:
they are quantized in 128x128 blocks at load (a checkpoint's row-scaled e4m3 experts are dequantized and
requantized; docs/quality.md).
"""
from __future__ import annotations

import importlib

import torch

from omni.quant import FP8_MAX, dequantize
from omni.specs import MoESpec, PreparedMoE, PreparedWeight, RowQuantized

from .moe import joined  # moe imports this module only from a function: no cycle
from .padded_route import padded_capacity

BLOCK = 128  # DeepGEMM's sm90 scale granularity: 1x128 for activations, 128x128 for weights
RECIPE = (1, BLOCK, BLOCK)


def block_quantize(w_ENK: torch.Tensor) -> PreparedWeight:
    """e4m3 weights with one fp32 scale per 128x128 block (``[E, N/128, K/128]``)."""
    return _by_expert(w_ENK.shape, w_ENK.device, lambda e: w_ENK[e].float())


def block_requantize(w: PreparedWeight) -> PreparedWeight:
    """A checkpoint's e4m3 experts (row or tensor scales) dequantized and quantized again in 128x128 blocks."""
    return _by_expert(w.data.shape, w.data.device, lambda e: dequantize(PreparedWeight(w.data[e], w.scale[e])))


def _by_expert(shape, device, expert_fp32) -> PreparedWeight:
    """Block quantization an expert at a time: a whole layer in fp32 would be 6 GiB at the released widths."""
    E, N, K = shape
    q = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(E, N // BLOCK, K // BLOCK, dtype=torch.float32, device=device)
    for e in range(E):
        blocks = expert_fp32(e).view(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        s = (blocks.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp_min(1e-12)
        q[e] = (blocks / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(N, K)
        scale[e] = s.view(N // BLOCK, K // BLOCK)
    return PreparedWeight(q, scale)


def block_dequantize(w: PreparedWeight) -> torch.Tensor:
    """fp32 ``[E, N, K]`` from ``block_quantize``'s form (the reference the conformance tests compare against)."""
    E, N, K = w.data.shape
    s = w.scale.reshape(E, N // BLOCK, 1, K // BLOCK, 1)
    return (w.data.float().view(E, N // BLOCK, BLOCK, K // BLOCK, BLOCK) * s).view(E, N, K)


def deepgemm_refusal(spec: MoESpec, sm: tuple[int, int]) -> str | None:
    """Why DeepGEMM cannot run ``spec``'s experts on an ``sm`` device (None: it can, once it imports)."""
    if spec.quant != "fp8_row":
        return f"kernels.grouped_fp8=deepgemm runs quant.scheme fp8_row only, not {spec.quant}"
    if sm != (9, 0):
        return f"kernels.grouped_fp8=deepgemm: its grouped kernel here is the sm90 one, this device is sm{sm[0]}{sm[1]}"
    if spec.hidden % BLOCK or spec.inner % BLOCK:
        return (f"kernels.grouped_fp8=deepgemm needs hidden and inner divisible by {BLOCK} (its scale blocks), "
                f"got {spec.hidden}/{spec.inner}")
    return None


def import_deepgemm():
    """``deep_gemm``, or why it does not import: the extra missing, or its JIT's CUDA toolkit not found."""
    try:
        return importlib.import_module("deep_gemm")
    except ImportError as err:
        return (f"kernels.grouped_fp8=deepgemm: deep_gemm does not import ({err}); pip install "
                "'omni-run[cuda-deepgemm]', with CUDA_HOME naming a CUDA toolkit (its kernels compile on first use)")
    except (OSError, RuntimeError) as err:  # its module loads libraries and looks for the toolkit at import
        return f"kernels.grouped_fp8=deepgemm: importing deep_gemm failed: {type(err).__name__}: {err}"


class DeepGemmMoE:
    """Routed experts on DeepGEMM's contiguous grouped fp8 GEMM (module docstring); ``kernels``: the memory-bound
    kernels of ``CudaMoE`` (the sort, the quantizing gather, SwiGLU, the combine)."""

    def __init__(self, spec: MoESpec, kernels, dg):
        self.spec, self.kernels, self.dg = spec, kernels, dg
        self.align = int(dg.get_mk_alignment_for_contiguous_layout())
        self.accepts_row_quantized = True  # rows the glue quantized per row: gathered, not requantized
        self.accepts_addends = True  # the combine adds the shared expert and the residual
        self.name = f"cuda-fused-moe[fp8_row,{kernels.name},deepgemm-contiguous,128x128-weight-blocks]"
        self.compiled = False  # DeepGEMM's kernels for this spec's GEMMs compiled (``compile_once``)

    def prepare_weights(self, w13_EOI: torch.Tensor, w2_EOI: torch.Tensor) -> PreparedMoE:
        return self.compile_once(PreparedMoE(self.kernel_layout(block_quantize(w13_EOI)),
                                             self.kernel_layout(block_quantize(w2_EOI))))

    def prepare_quantized_weights(self, w13: PreparedWeight, w2: PreparedWeight) -> PreparedMoE:
        """A checkpoint's e4m3 experts (reference scale layouts) -> requantized in 128x128 blocks."""
        return self.compile_once(PreparedMoE(self.kernel_layout(block_requantize(w13)),
                                             self.kernel_layout(block_requantize(w2))))

    def compile_once(self, prepared: PreparedMoE) -> PreparedMoE:
        """One call of each GEMM on the first CUDA weights it prepares (one layer's; the platform shares this MoE
        among layers of one spec). DeepGEMM compiles a kernel per GEMM shape on first use: 11.3 s for the
        released pair on an H100, which the first request paid before. Its configuration follows the padded size,
        which the worst-case bound keeps large (8,192 rows for one token of 64 experts): the same kernels served
        1 to 8,194 tokens there (BENCHMARKS.md, "Forty-fourth session")."""
        if self.compiled or not prepared.w13.data.is_cuda:
            return prepared
        dev, M = prepared.w13.data.device, padded_capacity(self.spec.topk, prepared.w13.data.shape[0], self.align)
        expert_M = torch.full((M,), -1, dtype=torch.int32, device=dev)
        expert_M[:self.align] = 0  # one block of expert 0: the rest is skipped
        for w in (prepared.w13, prepared.w2):
            q = torch.zeros(M, w.data.shape[2], dtype=torch.float8_e4m3fn, device=dev)
            self.gemm(q, torch.ones(M, 1, device=dev), w, expert_M)
        self.compiled = True
        return prepared

    def kernel_layout(self, w: PreparedWeight) -> PreparedWeight:
        """The block scales moved once, at load, into the layout DeepGEMM's kernel reads, and copied: where the
        layout is already right, 0.1.4.post1 hands back an alias that does not keep the input's storage alive
        (its tensor crosses tvm-ffi), so once the input was freed the GEMM read reused memory (on an H100 every
        output came out near zero: BENCHMARKS.md, "Forty-fourth session")."""
        E, N, K = w.data.shape
        scale = self.dg.transform_sf_into_required_layout(w.scale, N, K, RECIPE, E, False)
        return PreparedWeight(w.data, scale.clone())

    def __call__(self, x_TD, topk_weights_Tk, topk_ids_Tk, prepared: PreparedMoE, addends=()) -> torch.Tensor:
        """As ``CudaMoE.__call__`` (``x_TD``: rows or their ``RowQuantized`` form; ``addends``: terms the combine
        adds, or a callable returning them)."""
        route = self.kernels.route_padded(topk_ids_Tk, prepared.w13.data.shape[0], self.align)
        out_dtype = self.spec.dtype if isinstance(x_TD, RowQuantized) else x_TD.dtype
        if route.inverse_R.numel() == 0:  # an idle rank: no row to compute
            y = torch.empty(0, self.spec.hidden, dtype=torch.bfloat16, device=route.inverse_R.device)
            return self.kernels.combine(y, route.inverse_R, topk_weights_Tk, out_dtype, joined(addends))
        M, expert_M = route.expert_M.numel(), route.expert_M
        if isinstance(x_TD, RowQuantized):
            xq, xs = self.kernels.scatter_rows(x_TD.q_TI, x_TD.scale_T1, route.inverse_R, rows=M)
        else:
            xq, xs = self.kernels.quant_gather(x_TD.to(self.spec.dtype), route.token_M, expert_M)
        h = self.gemm(xq, xs, prepared.w13, expert_M)
        aq, as_ = self.kernels.swiglu(h, quantize=True, expert_R=expert_M)
        y = self.gemm(aq, as_, prepared.w2, expert_M)
        # the addends' callable joins the shared expert's side stream: called last, so it overlaps the GEMMs
        return self.kernels.combine(y, route.inverse_R, topk_weights_Tk, out_dtype, joined(addends))

    def gemm(self, q_MK: torch.Tensor, s_M1: torch.Tensor, w: PreparedWeight, expert_M: torch.Tensor):
        """``[M, N]`` bf16: each padded row times its expert's weight; the per-row scale repeated over the K blocks
        in DeepGEMM's MN-major scale layout (``[M, K/128]`` with stride ``(1, M)``; M is a multiple of 128, so
        TMA-aligned)."""
        M, K = q_MK.shape
        sf_MKb = s_M1.reshape(1, M).float().expand(K // BLOCK, M).contiguous().t()
        out = torch.empty(M, w.data.shape[1], dtype=torch.bfloat16, device=q_MK.device)
        self.dg.m_grouped_fp8_gemm_nt_contiguous((q_MK, sf_MKb), (w.data, w.scale), out, expert_M)
        return out


def resolve_deepgemm_moe(spec: MoESpec, sm: tuple[int, int], kernels, reject):
    """The DeepGEMM MoE ``kernels.grouped_fp8: deepgemm`` demands, or None after ``reject`` saying why not."""
    refusal = deepgemm_refusal(spec, sm)
    dg = import_deepgemm() if refusal is None else refusal
    if isinstance(dg, str):
        return reject(f"cuda-moe: {dg}")
    return DeepGemmMoE(spec, kernels, dg)
