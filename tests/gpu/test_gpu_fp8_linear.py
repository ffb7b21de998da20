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


@pytest.mark.parametrize("fast", [False, True])
def test_fp8_fast_accum_stays_near_the_dequantized_product(platform, fast, capsys):
    """kernels.fp8_fast_accum: the dense and the grouped fp8 GEMM against the fp64 product of their e4m3 operands."""
    from omni.specs import GroupedGemmSpec

    g = torch.Generator().manual_seed(1)
    E, R, K, N = 4, 256, 4096, 1024  # K as long as the released hidden size: where accumulation error grows
    x = torch.randn(E * R, K, generator=g).bfloat16().cuda()
    w = (torch.randn(E, N, K, generator=g) / K ** 0.5).bfloat16().cuda()
    offs = torch.arange(1, E + 1, dtype=torch.int32, device="cuda") * R
    dense = platform.linear(GemmSpec(in_features=K, out_features=N, dtype=torch.bfloat16, quant="fp8_row",
                                     fast_accum=fast))
    grouped = platform.grouped_gemm(GroupedGemmSpec(num_experts=E, in_features=K, out_features=N,
                                                    dtype=torch.bfloat16, quant="fp8_row", fast_accum=fast))
    assert ("fast-accum" in dense.name, "fast-accum" in grouped.name) == (fast, fast)
    xq, xs = quant.quantize_fp8(x, per_row=True)
    pw = grouped.prepare_weight(w)
    wd = pw.data.double() * pw.scale.double()
    sem_g = torch.cat([(xq[e * R:(e + 1) * R].double() * xs[e * R:(e + 1) * R].double()) @ wd[e].T for e in range(E)])
    y_g = grouped(x, pw, offs).double()
    y_d = dense(x, dense.prepare_weight(w[0]), None).double()
    sem_d = (xq.double() * xs.double()) @ wd[0].T
    errs = _rel(y_g, sem_g)[1], _rel(y_d, sem_d)[1]
    with capsys.disabled():
        print(f"\n[fp8 accumulate] fast={fast}: grouped fro {errs[0]:.2e} ({grouped.name}), "
              f"dense fro {errs[1]:.2e} ({dense.name})")
    assert max(errs) < (1e-2 if fast else 5e-3)  # bf16 output rounding alone is ~2e-3


def test_fp32_router_as_a_bf16_split_is_as_exact_as_fp32(platform, capsys):
    """The router's fp32 linear fed bf16 rows: the 3 x bf16 split against fp64, and the experts it picks."""
    g = torch.Generator().manual_seed(2)
    T, D, E = 8194, 4096, 64
    x = torch.randn(T, D, generator=g).bfloat16().cuda()
    w = (torch.randn(E, D, generator=g) / D ** 0.5).cuda()
    lin = platform.linear(GemmSpec(in_features=D, out_features=E, dtype=torch.float32))
    assert lin.name.startswith("cuda-linear[fp32 as 3 x bf16]")
    y = lin(x, lin.prepare_weight(w), None)
    exact = x.double() @ w.double().T
    fp32 = torch.nn.functional.linear(x.float(), w)
    assert y.dtype == torch.float32 and y.shape == (T, E)
    ours, torch_fp32 = _rel(y.double(), exact)[1], _rel(fp32.double(), exact)[1]
    with capsys.disabled():
        print(f"\n[router] split fro {ours:.2e} vs fp32 GEMM fro {torch_fp32:.2e} (against fp64)")
    assert ours < 1e-5  # measured 4.4e-6 (tensor-core fp32 accumulation) vs 4.1e-7 for the fp32 GEMM; bf16: ~2e-3
    # the same top-8 experts as the fp32 GEMM, but for rows whose 8th and 9th logits are closer than fp32 noise
    top_ours, top_ref = y.topk(9, -1), exact.topk(9, -1)
    clear = (top_ref.values[:, 7] - top_ref.values[:, 8]) > 1e-5
    same = (top_ours.indices[:, :8].sort(-1).values == top_ref.indices[:, :8].sort(-1).values).all(-1)
    assert bool(same[clear].all()) and clear.float().mean() > 0.99
