"""FP8 linear accuracy on the device: against its own quantization semantics and against exact math.

Two numbers per scheme: the error against the dequantized product that
``omni.quant`` defines (only accumulation order and the bf16 output rounding
may differ), and the error against the exact float64 product of the
unquantized inputs (the price of fp8). Activations carry a few outlier rows,
which is where per-tensor scaling loses to per-row.
"""
from __future__ import annotations

import pytest
import torch

from omni import quant
from omni.specs import GemmSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

M, I, O = 512, 2048, 1024


@pytest.fixture(scope="module")
def platform():
    from omni import platform_manager

    p = platform_manager.select("cuda")
    p.device_services(0)
    if "fp8" not in p.info.capabilities:
        pytest.skip(f"cuda: no fp8 on {p.info.device_name}")
    return p


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a-b| / max |b|, ||a-b|| / ||b||)."""
    d = (a - b).abs()
    return (d.max() / b.abs().max()).item(), (d.norm() / b.norm()).item()


@pytest.mark.parametrize("scheme,max_exact_rel", [("fp8_tensor", 0.08), ("fp8_row", 0.05)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_accuracy(platform, scheme, max_exact_rel, dtype, capsys):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, I, generator=g)
    x[::97] *= 20.0  # outlier tokens
    x = x.to(dtype).cuda()
    w = (torch.randn(O, I, generator=g) / I ** 0.5).to(dtype).cuda()
    lin = platform.linear(GemmSpec(in_features=I, out_features=O, dtype=dtype, quant=scheme))
    assert lin.name.startswith("cuda-scaled-mm")
    y = lin(x, lin.prepare_weight(w), None).double()

    xq, xs = quant.quantize_fp8(x, per_row=scheme == "fp8_row")
    semantics = (xq.double() * xs.double()) @ quant.dequantize(quant.prepare_weight(w, scheme)).double().T
    exact = x.double() @ w.double().T
    plain = torch.nn.functional.linear(x, w).double()
    sem_max, sem_fro = _rel(y, semantics)
    ex_max, ex_fro = _rel(y, exact)
    with capsys.disabled():
        print(f"\n[fp8] {lin.name} {dtype}: vs dequantized semantics max {(y - semantics).abs().max().item():.3e} "
              f"(rel {sem_max:.2e}, fro {sem_fro:.2e}); vs exact max {(y - exact).abs().max().item():.3e} "
              f"(rel {ex_max:.2e}, fro {ex_fro:.2e}); {dtype} linear vs exact fro {_rel(plain, exact)[1]:.2e}")
    assert sem_max < 1e-2 and sem_fro < 5e-3
    assert ex_fro < max_exact_rel
