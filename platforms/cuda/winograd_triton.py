"""F(2x2, 3x3) Winograd convolution for the CUDA glue (``conv3x3``): ``omni.winograd.conv3x3_winograd``.

Three launches: the input transform (Triton: each 4x4 window of a tile, ``B^T d B``
in fp32, stored in x's dtype as ``V [16, tiles, C]``), the 16 GEMMs (cuBLAS
``bmm`` against ``U [16, O, I]``, fp32 out, so the output transform sums
unrounded products), and the output transform (Triton: ``A^T M A``, the bias,
one rounding, the optional addend, written channels-last as the convolutions
of the image heads return). Each kernel reads its input through strides: a
channels-last or a contiguous ``[B, C, H, W]`` tensor works.

Only convolutions whose GEMMs dominate take it (``worth_it``: in x out channels at
least ``MIN_PRODUCT``). The transforms move about 16 x (2 C_in + 4 C_out) bytes
a tile against C_in x C_out products saved; measured on one H200 against cuDNN
(bf16, channels-last, 64x64 grid; BENCHMARKS.md, "Thirtieth session"):

    1024 -> 4096 (1 row) 1.22x   4096 -> 4096 (1 row) 1.69x   4096 -> 1024 (2 rows) 1.39x
    1024 -> 1024 (2 rows) 0.94x (left to cuDNN), and 32 in or out (the heads' first and last) is no contest.

May assume: 16 x tiles x channels < 2^31 (int32 offsets; the heads' rows of about 4096 tokens use an eighth).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from omni.winograd import TAPS, tiles, winograd_weights

from .triton_compile import run_or_compile

MIN_PRODUCT = 4096 * 1024  # in x out channels from which F(2x2, 3x3) gained (see above)
# The image's sizes (tiles, grid): one binary serves every image size. Triton would otherwise compile another
# binary wherever one of them changes between a multiple of 16 and not. Over the 33 sizes of the Instruct ratio
# table the heads' and the VAE's kernels compiled 46 binaries instead of 19, 8 later sizes 1-8 each, in the first
# request of that size (``bench/kernel_resources.py --sizes``, sm_90). The channel counts and strides stay
# specialized: they make the 16-byte vector loads and stores (the SASS at 64 x 64 is the same).
SHAPE_ARGS = ["T", "H", "W", "TW", "TILES_PER_IMAGE"]


class Launch(NamedTuple):
    """A transform's program: ``rows`` tiles x ``channels`` channels over ``warps`` warps. Each thread holds
    16 fp32 window values per (tile, channel) it owns: at 16 owned (32 x 64 over 4 warps) ptxas gives both
    transforms 255 registers and spills (52 / 100-196 bytes a thread, ``bench/kernel_resources.py``); at 8 they
    fit in 106 / 138-161. On the H200 no spill-free launch was faster on every convolution
    (``bench/bench_winograd.py --launches``, BENCHMARKS.md "Thirty-fourth session"), so the shipped one stays."""

    rows: int
    channels: int
    warps: int

    @classmethod
    def parse(cls, text: str) -> "Launch":
        """``"32x64x4"``: rows x channels x warps (powers of two: Triton's block shapes)."""
        parts = text.split("x")
        if len(parts) != 3 or not all(v.isdigit() and int(v) > 0 and int(v) & (int(v) - 1) == 0 for v in parts):
            raise ValueError(f"a Winograd launch is rows x channels x warps, each a power of two, e.g. 32x64x4; "
                             f"got {text!r}")
        return cls(*(int(v) for v in parts))


LAUNCH = Launch(32, 64, 4)


@triton.jit
def _bt(a0, a1, a2, a3):
    """B^T applied to four values along one axis of the tile."""
    return a0 - a2, a1 + a2, a2 - a1, a1 - a3


@triton.jit
def _at(a0, a1, a2, a3):
    """A^T applied to four values along one axis of the tile."""
    return a0 + a1 + a2, a1 - a2 - a3


@triton.jit
def _load(base, h, w, H, W, sh, sw, mask):
    inside = mask & (h >= 0)[:, None] & (h < H)[:, None] & (w >= 0)[:, None] & (w < W)[:, None]
    return tl.load(base + (h * sh + w * sw)[:, None], mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _row(base, h, w0, H, W, sh, sw, mask):
    """One row of a 4x4 window."""
    return (_load(base, h, w0, H, W, sh, sw, mask), _load(base, h, w0 + 1, H, W, sh, sw, mask),
            _load(base, h, w0 + 2, H, W, sh, sw, mask), _load(base, h, w0 + 3, H, W, sh, sw, mask))


@triton.jit
def _store_row(v_ptr, k0, plane, offs, a0, a1, a2, a3, mask):
    """Four taps ``k0 .. k0 + 3`` of V (planes of ``tiles * C``)."""
    ty = v_ptr.dtype.element_ty
    tl.store(v_ptr + k0 * plane + offs, a0.to(ty), mask=mask)
    tl.store(v_ptr + (k0 + 1) * plane + offs, a1.to(ty), mask=mask)
    tl.store(v_ptr + (k0 + 2) * plane + offs, a2.to(ty), mask=mask)
    tl.store(v_ptr + (k0 + 3) * plane + offs, a3.to(ty), mask=mask)


@triton.jit(do_not_specialize=SHAPE_ARGS)
def input_kernel(x_ptr, v_ptr, T, C, H, W, TW, TILES_PER_IMAGE, sb, sc, sh, sw,
                 BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (t < T)[:, None] & (c < C)[None, :]
    b, r = t // TILES_PER_IMAGE, t % TILES_PER_IMAGE
    h0, w0 = (r // TW) * 2 - 1, (r % TW) * 2 - 1
    base = x_ptr + (b * sb)[:, None] + (c * sc)[None, :]
    d00, d01, d02, d03 = _row(base, h0, w0, H, W, sh, sw, mask)
    d10, d11, d12, d13 = _row(base, h0 + 1, w0, H, W, sh, sw, mask)
    d20, d21, d22, d23 = _row(base, h0 + 2, w0, H, W, sh, sw, mask)
    d30, d31, d32, d33 = _row(base, h0 + 3, w0, H, W, sh, sw, mask)
    # columns first (B^T d), then rows ((B^T d) B)
    e00, e10, e20, e30 = _bt(d00, d10, d20, d30)
    e01, e11, e21, e31 = _bt(d01, d11, d21, d31)
    e02, e12, e22, e32 = _bt(d02, d12, d22, d32)
    e03, e13, e23, e33 = _bt(d03, d13, d23, d33)
    plane, offs = T * C, t[:, None] * C + c[None, :]
    v0, v1, v2, v3 = _bt(e00, e01, e02, e03)
    _store_row(v_ptr, 0, plane, offs, v0, v1, v2, v3, mask)
    v0, v1, v2, v3 = _bt(e10, e11, e12, e13)
    _store_row(v_ptr, 4, plane, offs, v0, v1, v2, v3, mask)
    v0, v1, v2, v3 = _bt(e20, e21, e22, e23)
    _store_row(v_ptr, 8, plane, offs, v0, v1, v2, v3, mask)
    v0, v1, v2, v3 = _bt(e30, e31, e32, e33)
    _store_row(v_ptr, 12, plane, offs, v0, v1, v2, v3, mask)


@triton.jit
def _taps(m_ptr, k0, plane, offs, mask):
    """Four taps ``k0 .. k0 + 3`` of M (fp32)."""
    return (tl.load(m_ptr + k0 * plane + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(m_ptr + (k0 + 1) * plane + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(m_ptr + (k0 + 2) * plane + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(m_ptr + (k0 + 3) * plane + offs, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _emit(y_ptr, add_ptr, val, bias, b, h, w, o, H, W, ysb, ysc, ysh, ysw, asb, asc, ash, asw, mask,
          HAS_ADD: tl.constexpr):
    """One output position of each tile: bias, one rounding, then the addend in the output dtype."""
    ty = y_ptr.dtype.element_ty
    inside = mask & ((h < H) & (w < W))[:, None]
    y = (val + bias[None, :]).to(ty)
    if HAS_ADD:
        a = tl.load(add_ptr + (b * asb + h * ash + w * asw)[:, None] + (o * asc)[None, :], mask=inside, other=0.0)
        y = (y.to(tl.float32) + a.to(tl.float32)).to(ty)
    tl.store(y_ptr + (b * ysb + h * ysh + w * ysw)[:, None] + (o * ysc)[None, :], y, mask=inside)


@triton.jit(do_not_specialize=SHAPE_ARGS)
def output_kernel(m_ptr, bias_ptr, add_ptr, y_ptr, T, O, H, W, TW, TILES_PER_IMAGE,
                  ysb, ysc, ysh, ysw, asb, asc, ash, asw,
                  HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    o = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = (t < T)[:, None] & (o < O)[None, :]
    plane, offs = T * O, t[:, None] * O + o[None, :]
    m00, m01, m02, m03 = _taps(m_ptr, 0, plane, offs, mask)
    m10, m11, m12, m13 = _taps(m_ptr, 4, plane, offs, mask)
    m20, m21, m22, m23 = _taps(m_ptr, 8, plane, offs, mask)
    m30, m31, m32, m33 = _taps(m_ptr, 12, plane, offs, mask)
    s00, s10 = _at(m00, m10, m20, m30)  # columns first (A^T M), then rows
    s01, s11 = _at(m01, m11, m21, m31)
    s02, s12 = _at(m02, m12, m22, m32)
    s03, s13 = _at(m03, m13, m23, m33)
    y00, y01 = _at(s00, s01, s02, s03)
    y10, y11 = _at(s10, s11, s12, s13)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + o, mask=o < O, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BC], dtype=tl.float32)
    b, r = t // TILES_PER_IMAGE, t % TILES_PER_IMAGE
    h, w = (r // TW) * 2, (r % TW) * 2
    _emit(y_ptr, add_ptr, y00, bias, b, h, w, o, H, W, ysb, ysc, ysh, ysw, asb, asc, ash, asw, mask, HAS_ADD)
    _emit(y_ptr, add_ptr, y01, bias, b, h, w + 1, o, H, W, ysb, ysc, ysh, ysw, asb, asc, ash, asw, mask, HAS_ADD)
    _emit(y_ptr, add_ptr, y10, bias, b, h + 1, w, o, H, W, ysb, ysc, ysh, ysw, asb, asc, ash, asw, mask, HAS_ADD)
    _emit(y_ptr, add_ptr, y11, bias, b, h + 1, w + 1, o, H, W, ysb, ysc, ysh, ysw, asb, asc, ash, asw, mask,
          HAS_ADD)


def worth_it(w_OI33: torch.Tensor) -> bool:
    """Whether F(2x2, 3x3) pays for this convolution: in x out channels at least ``MIN_PRODUCT``."""
    return w_OI33.shape[0] * w_OI33.shape[1] >= MIN_PRODUCT


def prepare(w_OI33: torch.Tensor) -> torch.Tensor | None:
    """``U [16, O, I]`` in the weight's dtype, or None where cuDNN's direct kernel should stay."""
    return winograd_weights(w_OI33, w_OI33.dtype) if worth_it(w_OI33) else None


def input_transform(x_BCHW: torch.Tensor, launch: Launch | None = None) -> torch.Tensor:
    """``V [16, tiles, C]`` in x's dtype (``omni.winograd.input_transform``), one launch (``LAUNCH`` by default)."""
    B, C, H, W = x_BCHW.shape
    launch = launch or LAUNCH
    th, tw = tiles(H, W)
    T = B * th * tw
    v_KTI = torch.empty(TAPS, T, C, dtype=x_BCHW.dtype, device=x_BCHW.device)
    if T:
        run_or_compile(input_kernel, (triton.cdiv(T, launch.rows), triton.cdiv(C, launch.channels)),
                       x_BCHW, v_KTI, T, C, H, W, tw, th * tw, *x_BCHW.stride(), BT=launch.rows, BC=launch.channels,
                       num_warps=launch.warps)
    return v_KTI


def output_transform(m_KTO: torch.Tensor, bias_O: torch.Tensor | None, addend_BOHW: torch.Tensor | None,
                     shape_BOHW: tuple[int, int, int, int], dtype: torch.dtype,
                     launch: Launch | None = None) -> torch.Tensor:
    """``addend + round(A^T M A + bias)``, channels-last ``[B, O, H, W]`` in ``dtype``, one launch (``LAUNCH`` by
    default)."""
    B, O, H, W = shape_BOHW
    launch = launch or LAUNCH
    th, tw = tiles(H, W)
    T = B * th * tw
    y = torch.empty(B, H, W, O, dtype=dtype, device=m_KTO.device).permute(0, 3, 1, 2)
    if T:
        add = addend_BOHW if addend_BOHW is not None else y
        run_or_compile(output_kernel, (triton.cdiv(T, launch.rows), triton.cdiv(O, launch.channels)),
                       m_KTO, bias_O if bias_O is not None else m_KTO, add, y, T, O, H, W, tw, th * tw, *y.stride(),
                       *add.stride(), HAS_BIAS=bias_O is not None, HAS_ADD=addend_BOHW is not None, BT=launch.rows,
                       BC=launch.channels, num_warps=launch.warps)
    return y


def conv3x3(x_BCHW: torch.Tensor, u_KOI: torch.Tensor, bias_O: torch.Tensor | None,
            addend_BOHW: torch.Tensor | None = None, *, m_dtype: torch.dtype = torch.float32,
            launch: Launch | None = None) -> torch.Tensor:
    """``addend + conv2d(x, w, bias, padding=1)`` with ``u_KOI = prepare(w)``; the result is channels-last."""
    B, _, H, W = x_BCHW.shape
    m_KTO = torch.bmm(input_transform(x_BCHW, launch), u_KOI.transpose(1, 2), out_dtype=m_dtype)
    return output_transform(m_KTO, bias_O, addend_BOHW, (B, u_KOI.shape[1], H, W), x_BCHW.dtype, launch)
