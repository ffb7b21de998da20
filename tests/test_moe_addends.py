"""The decoder layer's residual and shared-expert adds inside the MoE's combine (``accepts_addends``).

The golden tiny transformer in bf16 with the CUDA platform's fused MoE on its torch kernels (they run on CPU
tensors): the fused layer equals the separate bf16 adds within their roundings, and a parallel plan's hook on
the MLP or on the experts turns the fusion off, giving the separate adds bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from omni.build_options import BuildOptions
from omni.platform_manager import select


@pytest.fixture(scope="module")
def model(golden_data):
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
    from omni.models.hunyuan_image3.checkpoint_names import load_state
    from omni.platforms.cuda.moe import CudaMoE, TorchKernels

    m = HunyuanImage3Transformer(HunyuanImage3Config.from_json_dict(golden_data[0]["tiny_config"]), select("cpu"),
                                 BuildOptions(dtype=torch.bfloat16))
    load_state(m, golden_data[2])
    for layer in m.model.layers:  # before finalize: the experts are prepared for this kernel
        layer.mlp.experts.moe = CudaMoE(layer.mlp.experts._spec(), TorchKernels())
    m.finalize()
    return m.eval()


def layer_inputs(model, T: int = 19):
    g = torch.Generator().manual_seed(3)
    D = model.cfg.hidden_size
    return torch.randn(T, D, generator=g).bfloat16(), torch.randn(T, D, generator=g).bfloat16()


@torch.inference_mode()
def test_fused_residual_equals_the_separate_adds_within_their_roundings(model):
    mlp = model.model.layers[0].mlp
    n, h = layer_inputs(model)
    assert mlp.experts.takes_addends
    fused = mlp(n, residual_TD=h)
    separate = h + mlp(n)  # shared + routed rounded, then the residual rounded
    assert not torch.equal(fused, separate)  # the fused combine really ran (one rounding instead of three)
    scale = h.float().abs() + mlp(n).float().abs() + separate.float().abs()
    assert ((fused.float() - separate.float()).abs() <= 2 ** -7 * scale + 2 ** -24).all()


def official_order(mlp, n, h):
    """``h + (shared + routed)`` with every add rounded in bf16: the official code's order."""
    w, ids = mlp.gate(n)
    g13, g2 = mlp.experts.gate_and_up_proj, mlp.experts.down_proj
    from omni.specs import PreparedMoE

    routed = mlp.experts.moe(n, w, ids, PreparedMoE(g13.prepared, g2.prepared))
    return h + (mlp.shared_mlp(n) + routed)


@torch.inference_mode()
def test_a_hook_on_the_experts_keeps_the_adds_outside(model):
    """An expert dispatch (a plan's hooks on the experts) must see the routed rows' own output."""
    mlp = model.model.layers[0].mlp
    n, h = layer_inputs(model)
    seen = []
    handle = mlp.experts.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    try:
        assert not mlp.experts.takes_addends
        assert torch.equal(mlp(n, residual_TD=h), official_order(mlp, n, h)) and seen == [n.shape]
    finally:
        handle.remove()
    assert mlp.experts.takes_addends  # the hook is gone: fused again
    assert not torch.equal(mlp(n, residual_TD=h), official_order(mlp, n, h))


@torch.inference_mode()
def test_the_decoder_layer_adds_the_residual_outside_a_hooked_mlp(model):
    layer = model.model.layers[0]
    x, _ = layer_inputs(model)
    T, H = x.shape[0], model.cfg.head_dim
    cos, sin = torch.ones(T, H, dtype=torch.bfloat16), torch.zeros(T, H, dtype=torch.bfloat16)
    from omni.kv_pool import KVPool, PoolContext, Run

    pool = KVPool(num_layers=len(model.model.layers), num_pages=2, page_size=32,
                  num_kv_heads=model.cfg.num_key_value_heads, head_dim=H, dtype=torch.bfloat16, device="cpu")
    pages = tuple(pool.allocate(T))
    ctx = PoolContext(pool, [Run(pages, 0, T, T)], "causal", False, "cpu")
    fused = layer(x, cos, sin, ctx)
    kwargs_seen = []
    handle = layer.mlp.register_forward_hook(lambda m, args, kw, out: kwargs_seen.append(dict(kw)), with_kwargs=True)
    try:
        unfused = layer(x, cos, sin, ctx)
    finally:
        handle.remove()
    assert kwargs_seen == [{}]  # the hooked MLP ran on its own: the layer added the residual after the hook
    assert not torch.equal(fused, unfused)
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2 ** -6, atol=2 ** -6 * unfused.float().abs().max())
