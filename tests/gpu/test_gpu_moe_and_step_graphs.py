"""The fused CUDA MoE (Triton and torch memory kernels) and the captured denoising step, on a CUDA device.

- ``CudaMoE`` with its Triton kernels == with its torch kernels == the reference MoE, bf16 and fp8_row,
  at a shape with empty and busy experts; and the layer captures into a CUDA graph (no host sync).
- A small HunyuanImage-3 transformer (released structure, narrow widths) on the prefix-KV step:
  ``StepGraphs`` replay == the eager backbone, for a new input, and again after rebinding to other
  KV pages of the same signature.
"""
from __future__ import annotations

import math

import pytest
import torch

from golden_utils import tiny_config_at

from omni.build_options import BuildOptions
from omni.specs import MoESpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("quant", ["none", "fp8_row", "fp8_tensor"])
def test_fused_moe_triton_torch_reference_agree(platform, quant, capsys):
    from omni.platform_manager import select
    from omni.platforms.cuda.moe import CudaMoE, TorchKernels, memory_kernels

    E, k, D, inner, T = 16, 4, 512, 256, 777
    spec = MoESpec(num_experts=E, topk=k, hidden=D, inner=inner, dtype=torch.bfloat16, quant=quant)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g).bfloat16().cuda()
    logits = torch.randn(T, E, generator=g)
    logits[:, 3] += 4.0  # a busy expert
    logits[:, 7:9] -= 100.0  # two empty ones
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    w, ids = (w / w.sum(-1, keepdim=True)).cuda(), ids.cuda()
    w13 = (torch.randn(E, 2 * inner, D, generator=g) / math.sqrt(D)).bfloat16().cuda()
    w2 = (torch.randn(E, D, inner, generator=g) / math.sqrt(inner)).bfloat16().cuda()

    fused = platform.moe(spec)
    assert fused.name.startswith("cuda-fused-moe"), fused.name
    torchk = CudaMoE(spec, kernels=TorchKernels())
    ref = select("cpu").moe(spec)
    y_fused = fused(x, w, ids, fused.prepare_weights(w13, w2))
    y_torch = torchk(x, w, ids, torchk.prepare_weights(w13, w2))
    y_ref = ref(x.cpu(), w.cpu(), ids.cpu(), ref.prepare_weights(w13.cpu(), w2.cpu()))
    e_ft, e_fr = _rel(y_fused, y_torch), _rel(y_fused.cpu(), y_ref)
    with capsys.disabled():
        print(f"\n[moe {quant}] {fused.name}: vs torch kernels {e_ft:.2e}, vs reference {e_fr:.2e} "
              f"({type(memory_kernels('auto', pytest.fail)).__name__})")
    assert e_ft < (2e-2 if quant != "none" else 5e-3) and e_fr < (3e-2 if quant != "none" else 1e-2)

    prepared = fused.prepare_weights(w13, w2)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    fused(static_x, w, ids, prepared)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y_static = fused(static_x, w, ids, prepared)
    static_x.copy_(torch.randn(T, D, generator=g).bfloat16().cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(y_static, fused(static_x, w, ids, prepared)) < 1e-3


def test_fused_moe_takes_rows_the_glue_quantized(platform):
    """The fp8_row MoE scatters ``RowQuantized`` rows as they are into the sort's order (Triton copy == torch
    indexing == the rows gathered by each sorted row's token, bit for bit), and the layer's output matches the
    plain-rows path (its own Triton quantization of the same rows)."""
    from omni import quant
    from omni.platforms.cuda.moe import TorchKernels, memory_kernels
    from omni.specs import RowQuantized

    E, k, D, inner, T = 16, 4, 512, 256, 777
    spec = MoESpec(num_experts=E, topk=k, hidden=D, inner=inner, dtype=torch.bfloat16, quant="fp8_row")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    w, ids = torch.rand(T, E, device="cuda", generator=g).softmax(-1).topk(k, -1)
    q, s = quant.quantize_fp8(x, per_row=True)
    triton_kernels = memory_kernels("triton", pytest.fail)
    token, inverse, _ = triton_kernels.route_rows(ids, E)
    by_token = (q[token], s.reshape(-1, 1)[token])
    for kernels in (triton_kernels, TorchKernels()):
        for a, b in zip(kernels.scatter_rows(q, s, inverse), by_token):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    fused = platform.moe(spec)
    assert fused.accepts_row_quantized
    prepared = fused.prepare_weights((torch.randn(E, 2 * inner, D, device="cuda") / D ** 0.5).bfloat16(),
                                     (torch.randn(E, D, inner, device="cuda") / inner ** 0.5).bfloat16())
    y_rows, y_plain = fused(RowQuantized(q, s, x), w, ids, prepared), fused(x, w, ids, prepared)
    assert _rel(y_rows, y_plain) < 1e-3


def _small_cfg():
    return tiny_config_at(hidden=256, heads=4, kv_heads=2, head_dim=64, experts=8, topk=2, inner=128)


@pytest.mark.parametrize("quant,side", [("none", False), ("fp8_row", False), ("fp8_row", True)])
def test_captured_step_equals_eager(platform, quant, side, capsys):
    """``side``: the shared expert on a side stream (``kernels.shared_expert_stream``), captured with it."""
    import sys
    from pathlib import Path

    from omni.kv_pool import KVPool, PoolContext, Run
    from omni.step_graphs import StepGraphs
    from omni.models.hunyuan_image3.rope import rope_cos_sin
    from omni.models.hunyuan_image3.sequence import rope_positions
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from random_fullsize import random_init_

    cfg = _small_cfg()
    with torch.device("cuda"):
        opts = BuildOptions(dtype=torch.bfloat16, quant=quant, capturable=True, shared_expert_stream=side)
        model = HunyuanImage3Transformer(cfg, platform, opts)
    random_init_(model)
    model.finalize()
    P, th, tw, rows = 37, 8, 12, 2
    n = 1 + th * tw
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_pages=16, page_size=64, num_kv_heads=cfg.num_key_value_heads,
                  head_dim=cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    pos = torch.tensor(rope_positions(P + n + 1, P + 1, th, tw), device="cuda")
    cos, sin = (t.to(torch.bfloat16) for t in rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta))
    g = torch.Generator(device="cuda").manual_seed(0)

    def rows_pages():
        pages = [tuple(pool.allocate(P + n)) for _ in range(rows)]
        with torch.inference_mode():  # prefill both rows' prefixes
            ctx = PoolContext(pool, [Run(p, 0, P, P) for p in pages], "causal", False, "cuda")
            model.backbone(torch.randn(rows * P, cfg.hidden_size, device="cuda", generator=g).bfloat16(),
                           cos[:P].repeat(rows, 1), sin[:P].repeat(rows, 1), ctx)
        return pages

    def args(pages):
        runs = [r for p in pages for r in (Run(p, P, P + 1, P + 1), Run(p, P + 1, P + n, P + n))]
        return (cos[P:P + n].repeat(rows, 1), sin[P:P + n].repeat(rows, 1),
                PoolContext(pool, runs, "none", False, "cuda"))

    graphs = StepGraphs(platform, "cuda")
    sig = ((P, th, tw),) * rows
    errs = []
    with torch.inference_mode():
        for pages in (rows_pages(), rows_pages()):  # the second set: same signature, other pages (rebind)
            for _ in range(2):
                x = torch.randn(rows * n, cfg.hidden_size, device="cuda", generator=g).bfloat16()
                got = graphs.run((sig, tuple(pages)), x, model.backbone, lambda: args(pages)).clone()
                want = model.backbone(x, *args(pages))
                errs.append(_rel(got, want))
    with capsys.disabled():
        print(f"\n[step graph {quant}, side stream {side}] captures {graphs.captures}, rebinds {graphs.rebinds}, "
              f"replays {graphs.replays}; replay vs eager rel err {max(errs):.2e}")
    assert graphs.captures == 1 and graphs.rebinds == 1 and graphs.replays == 4
    assert max(errs) < 1e-3


def test_shared_expert_stream_same_bits(platform):
    """The shared expert on a side stream gives the inline model's output bit for bit (same kernels, same inputs),
    on a prefill and a step whose experts' work overlaps it."""
    import sys
    from pathlib import Path

    from omni.kv_pool import KVPool, PoolContext, Run
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
    from omni.streams import SideStream

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from random_fullsize import random_init_

    cfg = _small_cfg()
    outs = []
    for side in (False, True):
        with torch.device("cuda"):
            model = HunyuanImage3Transformer(cfg, platform, BuildOptions(dtype=torch.bfloat16, quant="fp8_row",
                                                                         shared_expert_stream=side))
        random_init_(model, seed=3)
        model.finalize()
        assert isinstance(model.model.layers[0].mlp.side, SideStream) == side
        pool = KVPool(num_layers=cfg.num_hidden_layers, num_pages=4, page_size=64,
                      num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=torch.bfloat16, device="cuda")
        pages = tuple(pool.allocate(200))
        g = torch.Generator(device="cuda").manual_seed(5)
        x = torch.randn(200, cfg.hidden_size, device="cuda", generator=g).bfloat16()
        cos = torch.randn(200, cfg.head_dim, device="cuda", generator=g).bfloat16()
        with torch.inference_mode():
            ctx = PoolContext(pool, [Run(pages, 0, 200, 200)], "causal", False, "cuda")
            outs.append(model.backbone(x, cos, cos.flip(0), ctx).clone())
        torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
