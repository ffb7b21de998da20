"""The fused glue of the CUDA platform (``omni_glue_impl``): Triton kernels, or the reference's torch ops.

May assume: tensors live on the worker's CUDA device. One launch per step,
none reads the host, so all of it is capturable:

    rms_norm / add_rms_norm   residual add, RMSNorm and the fp8 row quantization of the result (one pass)
    rope_qk_norm              split of the packed qkv, RoPE and the per-head QK-norm of q and k (one pass)
    swiglu                    x1 * silu(x2) and its fp8 row quantization (the MoE's SwiGLU kernel)
    route                     softmax, top-k and renormalisation of the router logits (one pass)
    store_gather_kv           a forward's K/V into the pool and its key table out of it (one launch)
    group_norm                GroupNorm [+ FiLM] [+ SiLU] of the image heads and the VAE (``group_norm_triton``)
    conv3x3 (+ _weights)      the image heads' wide 3x3 convolutions by Winograd F(2x2, 3x3) (``winograd_triton``)

``spec.memory_bound`` picks as for the GEMMs: ``auto`` Triton when it
imports, ``torch`` the reference's ops (``omni.reference_glue``), ``triton``
demands Triton. Shapes Triton cannot tile (a head_dim that is not a power of
two) are refused with the reason, and the reference answers.
"""
from __future__ import annotations

import torch

from omni.group_norm import group_norm_act
from omni.kv_pool import store_gather_kv
from omni.reference_glue import ReferenceGlue
from omni.specs import GlueSpec, RowQuantized

from .capabilities import Caps, triton_found
from .moe import memory_kernels
from .triton_compile import compile_only


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class TritonGlue:
    """``GlueImpl`` over ``glue_triton``'s kernels (see the module docstring)."""

    def __init__(self, spec: GlueSpec, moe_kernels):
        import triton

        from . import glue_triton, group_norm_triton, winograd_triton
        from .pdl_triton import launch

        self.spec, self.k, self.swiglu_kernels, self.triton = spec, glue_triton, moe_kernels, triton
        self.group_norm_kernels, self.pdl = group_norm_triton, moe_kernels.pdl  # kernels.pdl_rows
        self.winograd, self.launch = winograd_triton, launch  # launch: with the PDL classes compiled together
        self.tiles = dict(glue_triton.TILES)  # launch shapes per kernel (a benchmark may try others)
        self.block = triton.next_power_of_2(spec.hidden)
        self.name = "cuda-triton-glue"
        self.host = ReferenceGlue(spec)  # CPU tensors (the plugin's CPU tests) take the reference's ops

    def _norm(self, x, d, w, quantize: bool):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        T, D = x2.shape
        y, h = torch.empty_like(x2), (torch.empty_like(x2) if d is not None else None)
        q = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=x.device) if quantize else y
        s = torch.empty(T, 1, dtype=torch.float32, device=x.device) if quantize else y
        if T:
            dd = d.reshape(-1, D).contiguous() if d is not None else x2
            tile = self.tiles["norm"]
            self.launch(
                self.k.norm_kernel, (self.triton.cdiv(T, tile.rows),), self.pdl, T,
                x2, dd, w, h if h is not None else y, y, q, s, T, D, self.spec.eps, BLOCK=self.block, ROWS=tile.rows,
                ADD=d is not None, QUANT=quantize, QMAX=self.k.FP8_MAX, num_warps=tile.warps)
        y = y.view(x.shape)
        out = RowQuantized(q, s, y) if quantize else y
        return out if h is None else (h.view(x.shape), out)

    def rms_norm(self, x_TD, w_D, quantize: bool):
        if not x_TD.is_cuda:
            return self.host.rms_norm(x_TD, w_D, quantize)
        return self._norm(x_TD, None, w_D, quantize)

    def add_rms_norm(self, x_TD, d_TD, w_D, quantize: bool):
        if not x_TD.is_cuda:
            return self.host.add_rms_norm(x_TD, d_TD, w_D, quantize)
        return self._norm(x_TD, d_TD, w_D, quantize)

    def rope_qk_norm(self, qkv_TO, cos_TH, sin_TH, wq_H, wk_H, heads_NK):
        if not qkv_TO.is_cuda:
            return self.host.rope_qk_norm(qkv_TO, cos_TH, sin_TH, wq_H, wk_H, heads_NK)
        N, K = heads_NK
        T, H = qkv_TO.shape[0], self.spec.head_dim
        qkv = qkv_TO.contiguous()
        q = torch.empty(T, N, H, dtype=qkv.dtype, device=qkv.device)
        k, v = torch.empty(T, K, H, dtype=qkv.dtype, device=qkv.device), torch.empty(T, K, H, dtype=qkv.dtype,
                                                                                    device=qkv.device)
        if T:
            tile = self.tiles["rope"]
            self.launch(
                self.k.rope_norm_kernel, (self.triton.cdiv(T, tile.rows), K), self.pdl, T,
                qkv, cos_TH.contiguous(), sin_TH.contiguous(), wq_H, wk_H, q, k, v, T, self.spec.eps, K=K, G=N // K,
                H=H, ROWS=tile.rows, num_warps=tile.warps)
        return q, k, v

    def swiglu(self, h_T2I, quantize: bool):
        if not h_T2I.is_cuda:
            return self.host.swiglu(h_T2I, quantize)
        out, scale = self.swiglu_kernels.swiglu(h_T2I, quantize=quantize, tile=self.tiles["swiglu"])
        return RowQuantized(out, scale) if quantize else out

    def route(self, logits_TE):
        if not logits_TE.is_cuda:
            return self.host.route(logits_TE)
        return self._route(logits_TE.contiguous())

    def _route(self, x):
        T, E = x.shape
        k, extra = self.spec.topk, self.spec.always_on
        w = torch.empty(T, k + extra, dtype=torch.float32, device=x.device)
        ids = torch.empty(T, k + extra, dtype=torch.int64, device=x.device)
        if T:
            tile = self.tiles["route"]
            self.launch(
                self.k.route_kernel, (self.triton.cdiv(T, tile.rows),), self.pdl, T,
                x, w, ids, T, E, TOPK=k, BLOCK_T=tile.rows, BLOCK_E=self.triton.next_power_of_2(E),
                KPAD=self.triton.next_power_of_2(k + extra), ALWAYS=extra, num_warps=tile.warps)
        if compile_only():  # the kernel did not run: ids that index experts must hold real ones (the reference's)
            return self.host.route(x)
        return w, ids

    def group_norm(self, x, num_groups, weight, bias, eps, **chain):
        """``omni.group_norm.group_norm_act`` (``chain``: its keyword arguments) in three launches."""
        act = self.group_norm_kernels.group_norm_act if x.is_cuda else group_norm_act
        return act(x, num_groups, weight, bias, eps, **chain)

    def conv3x3_weights(self, w_OI33):
        """The Winograd weights of a CUDA 3x3 convolution wide enough to gain (``winograd_triton.worth_it``), else
        None (cuDNN's direct kernel stays)."""
        return self.winograd.prepare(w_OI33) if w_OI33.is_cuda else None

    def conv3x3(self, x_BCHW, u_KOI, bias_O, addend_BOHW=None):
        """``omni.winograd.conv3x3_winograd`` in three launches (two Triton, one cuBLAS); channels-last out."""
        return self.winograd.conv3x3(x_BCHW, u_KOI, bias_O, addend_BOHW)

    def store_gather_kv(self, k_pool_PKH, v_pool_PKH, k_TKH, v_TKH, write_T, gather_S, fresh_S):
        same = k_TKH.dtype == k_pool_PKH.dtype and v_TKH.dtype == v_pool_PKH.dtype
        if not (k_TKH.is_cuda and same and k_pool_PKH.is_contiguous() and v_pool_PKH.is_contiguous()):
            return store_gather_kv(k_pool_PKH, v_pool_PKH, k_TKH, v_TKH, write_T, gather_S, fresh_S)
        k, v = k_TKH.contiguous(), v_TKH.contiguous()
        S, T, W = gather_S.numel(), write_T.numel(), k_pool_PKH[0].numel()
        ko = torch.empty((S, *k_pool_PKH.shape[1:]), dtype=k.dtype, device=k.device)
        vo = torch.empty_like(ko)
        if S + T:
            self.launch(self.k.kv_kernel, (S + T,), self.pdl, S + T,
                        k_pool_PKH, v_pool_PKH, k, v, write_T, gather_S, fresh_S, ko, vo, S, W,
                        BLOCK=self.triton.next_power_of_2(W), num_warps=4)
        return ko, vo


def resolve_glue(spec: GlueSpec, caps: Caps, reject):
    """Triton glue where it imports and the shapes tile; the reference's torch ops under ``memory_bound: torch``."""
    kernels = memory_kernels(spec.memory_bound, reject, spec.pdl_rows, caps.sm)
    if kernels is None:
        return None
    if kernels.name == "torch":
        return ReferenceGlue(spec)
    if not _pow2(spec.head_dim):
        return reject(f"cuda-glue: the Triton RoPE + QK-norm kernel needs a power-of-two head_dim, "
                      f"got {spec.head_dim}")
    if spec.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return reject(f"cuda-glue: no Triton glue for activations of {spec.dtype}")
    return TritonGlue(spec, kernels) if triton_found() else None
