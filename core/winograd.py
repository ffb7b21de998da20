"""3x3 convolutions (stride 1, padding 1) by Winograd's F(2x2, 3x3): the definition and the module hook.

The image heads' convolutions are compute-bound: one 1024x1024 step's patch
embedding runs a 1024->4096 and a 4096->4096 3x3 convolution over the 64x64
latent grid (1.55 TFLOP), which cuDNN computes at about the bf16 GEMM rate.
F(2x2, 3x3) computes each 2x2 block of outputs from a 4x4 input tile with 16
elementwise products where the direct form needs 36: the convolution becomes
16 independent GEMMs ``M_k = V_k @ U_k`` (k over the 4x4 transformed tile),
2.25x fewer multiply-adds, plus two memory-bound transforms:

    V = B^T d B     (input tile d, 4x4 per channel)     U = G g G^T   (weights g, 3x3 -> 4x4, once at build)
    Y = A^T M A     (2x2 outputs per tile)

The transforms' coefficients are 0, +-1 and 1/2, so F(2x2, 3x3) adds only a
few roundings to the direct form (larger tiles, F(4x4, 3x3), need
coefficients up to 8 and lose bits; they are not offered).

Here: the matrices, ``winograd_weights`` (U of a weight, computed in fp32),
``conv3x3_winograd`` (the whole convolution in torch ops: the definition the
platforms' kernels are tested against), and ``FusableConv3x3``: an
``nn.Conv2d`` (same parameters and state-dict names) that a platform's glue
may compute at build (``use_conv3x3_kernel``; the optional glue methods
``conv3x3_weights`` / ``conv3x3`` of ``omni_glue_impl``). Its ``forward``
takes an optional ``addend`` (the ResBlock's skip branch) so a kernel can add
it in the output transform; the torch path adds it as ``addend + conv(x)``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

B_T = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))  # input transform, 4x4
G = ((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1))  # weight transform, 4x3
A_T = ((1, 1, 1, 0), (0, 1, -1, -1))  # output transform, 2x4
TAPS = 16  # the 4x4 transformed tile: one GEMM each


def _matrix(rows, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=like.dtype, device=like.device)


def winograd_weights(w_OI33: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``U`` ``[16, O, I]`` in ``dtype`` (tap k = 4 * row + col of ``G g G^T``), computed in fp32 (float64 for
    float64 weights) from the 3x3 weights ``[O, I, 3, 3]``."""
    if tuple(w_OI33.shape[2:]) != (3, 3):
        raise ValueError(f"winograd_weights needs 3x3 weights, got shape {tuple(w_OI33.shape)}")
    w = w_OI33.to(accumulation_dtype(w_OI33.dtype))
    g = _matrix(G, w)
    u_OI44 = g @ w @ g.T
    return u_OI44.permute(2, 3, 0, 1).reshape(TAPS, *w.shape[:2]).to(dtype).contiguous()


def tiles(h: int, w: int) -> tuple[int, int]:
    """The 2x2 output tiles covering an ``h x w`` output (the last row / column may hang over)."""
    return (h + 1) // 2, (w + 1) // 2


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or float64 for float64 inputs (the definition's exact-arithmetic check)."""
    return torch.promote_types(dtype, torch.float32)


def input_transform(x_BCHW: torch.Tensor) -> torch.Tensor:
    """``V`` ``[16, B*th*tw, C]`` in x's dtype: each tile's zero-padded 4x4 window, ``B^T d B`` in fp32."""
    B, C, H, W = x_BCHW.shape
    th, tw = tiles(H, W)
    padded = F.pad(x_BCHW.to(accumulation_dtype(x_BCHW.dtype)), (1, 2 * tw + 1 - W, 1, 2 * th + 1 - H))
    d_BCthtw44 = padded.unfold(2, 4, 2).unfold(3, 4, 2)
    bt = _matrix(B_T, d_BCthtw44)
    v = torch.einsum("ir,bcyxrs,js->ijbyxc", bt, d_BCthtw44, bt)
    return v.reshape(TAPS, B * th * tw, C).to(x_BCHW.dtype)


def output_transform(m_KTO: torch.Tensor, shape_BOHW: tuple[int, int, int, int]) -> torch.Tensor:
    """``Y = A^T M A`` in fp32 (float64 for float64 ``M``): ``[B, O, H, W]`` from the 16 GEMM results
    ``[16, B*th*tw, O]``."""
    B, O, H, W = shape_BOHW
    th, tw = tiles(H, W)
    m = m_KTO.to(accumulation_dtype(m_KTO.dtype)).reshape(4, 4, B, th, tw, O)
    at = _matrix(A_T, m)
    y_BOthatwb = torch.einsum("ai,ijbyxo,cj->boyaxc", at, m, at)
    return y_BOthatwb.reshape(B, O, 2 * th, 2 * tw)[:, :, :H, :W]


def conv3x3_winograd(x_BCHW: torch.Tensor, u_KOI: torch.Tensor, bias_O: torch.Tensor | None,
                     addend_BOHW: torch.Tensor | None = None) -> torch.Tensor:
    """``addend + conv2d(x, w, bias, padding=1)`` by F(2x2, 3x3), ``u_KOI = winograd_weights(w)``.

    The definition of the glue's ``conv3x3``: V and U in their dtype (x's), the 16 GEMMs accumulated and
    returned in fp32, the output transform and the bias in fp32, rounded to x's dtype, then the addend added
    in x's dtype (as ``addend + conv(x)`` rounds). Float64 inputs keep float64 throughout.
    """
    B, _, H, W = x_BCHW.shape
    acc = accumulation_dtype(x_BCHW.dtype)
    v_KTI = input_transform(x_BCHW)
    m_KTO = torch.bmm(v_KTI.to(acc), u_KOI.to(acc).transpose(1, 2))
    y = output_transform(m_KTO, (B, u_KOI.shape[1], H, W))
    if bias_O is not None:
        y = y + bias_O.to(acc).view(1, -1, 1, 1)
    y = y.to(x_BCHW.dtype)
    return y if addend_BOHW is None else addend_BOHW + y


class FusableConv3x3(nn.Conv2d):
    """A 3x3, stride 1, padding 1 ``nn.Conv2d`` that a platform's glue may compute (``use_conv3x3_kernel``).

    Without a kernel it is ``nn.Conv2d`` (plus ``addend``). With one, the module holds the glue's prepared
    weights (``winograd``, a buffer that moves with the module) and its 3x3 ``weight`` is released: the
    preparation is one-way, like the fp8 layers' quantization at ``finalize()``.
    """

    kernel = None

    def __init__(self, c_in: int, c_out: int, *, dtype: torch.dtype):
        super().__init__(c_in, c_out, kernel_size=3, padding=1, dtype=dtype)

    def forward(self, x_BCHW: torch.Tensor, addend_BOHW: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x_BCHW, self.winograd, self.bias, addend_BOHW)
        y = super().forward(x_BCHW)
        return y if addend_BOHW is None else addend_BOHW + y


def use_conv3x3_kernel(glue, *modules: nn.Module) -> int:
    """Give each ``FusableConv3x3`` inside ``modules`` the glue's ``conv3x3`` where its ``conv3x3_weights``
    accepts the shape (returns the prepared weights, or None to keep the torch convolution); returns how many."""
    prepare, kernel = getattr(glue, "conv3x3_weights", None), getattr(glue, "conv3x3", None)
    if prepare is None or kernel is None:
        return 0
    taken = 0
    for module in modules:
        for conv in module.modules():
            if isinstance(conv, FusableConv3x3) and conv.kernel is None:
                prepared = prepare(conv.weight.detach())
                if prepared is not None:
                    conv.register_buffer("winograd", prepared, persistent=False)
                    conv.weight.data = conv.weight.data.new_empty(0)
                    conv.kernel, taken = kernel, taken + 1
    return taken
