"""Layerwise offload: outputs equal resident execution; copies rotate through the slots as planned."""
from __future__ import annotations

import pytest
import torch

from golden_utils import build_golden_model
from omni.device import DeviceServices
from omni.kv_pool import KVPool, PoolContext, Run
from omni.offload import EXPERTS_ONLY, LayerOffloader
from omni.platform_manager import select
from omni.models.hunyuan_image3.rope import rope_cos_sin


def run_case_a(model, g):
    """Prefill + one image step of golden case A through the pool path; returns the velocity."""
    cfg = model.cfg
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_pages=16, page_size=8, num_kv_heads=cfg.num_key_value_heads,
                  head_dim=cfg.head_dim, dtype=torch.float32, device="cpu")
    P, pos = int(g["A.gen_timestep_scatter_index"][0, 0]), g["A.rope_pos_yx"]
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta)
    pages = tuple(pool.allocate(28))
    model.backbone(model.embed_tokens(g["A.input_ids"][0, :P]), cos[:P], sin[:P],
                   PoolContext(pool, [Run(pages, 0, P, P)], "causal", False, "cpu"))
    t = torch.tensor([1000.0])
    x = torch.cat([model.timestep_token(t), model.image_tokens(g["A.latents_xt"], t)[0]])
    ctx = PoolContext(pool, [Run(pages, P, P + 1, P + 1), Run(pages, P + 1, P + 17, P + 17)], "none", False, "cpu")
    h = model.backbone(x, cos[P:P + 17], sin[P:P + 17], ctx)
    return model.velocity(h[None, 1:], t, 4, 4)


@torch.inference_mode()
@pytest.mark.parametrize("resident, window, keep", [(0, 1, None), (1, 1, None), (0, 2, None), (0, 1, EXPERTS_ONLY)],
                         ids=["all-w1", "resident1-w1", "all-w2", "experts-w1"])
def test_offloaded_layers_match_resident(golden_data, resident, window, keep):
    g = golden_data[1]
    want = run_case_a(build_golden_model(golden_data, select("cpu")), g)
    model = build_golden_model(golden_data, select("cpu"))
    layers = list(model.model.layers)
    off = LayerOffloader(layers, DeviceServices("cpu"), resident=resident, window=window,
                         **({} if keep is None else {"keep": keep}))
    for _ in range(2):  # two forwards per call (prefill + step), run twice: slots wrap around
        torch.testing.assert_close(run_case_a(model, g), want, atol=0, rtol=0)
    n_off, slots = len(layers) - resident, min(window, len(layers) - resident)
    assert off.stats.bytes_copied == off.stats.copies * (off.host_bytes // n_off)
    if slots == n_off:  # every offloaded block has its own slot: copied once, then stays
        assert off.stats.copies == n_off
    else:  # 4 forwards, each streams every offloaded block once (+ the wrap-around prefetch)
        assert 4 * n_off <= off.stats.copies <= 4 * n_off + slots
    if keep is EXPERTS_ONLY:
        assert all(".experts." in f".{n}" for h in off.host.values() for n in h)
