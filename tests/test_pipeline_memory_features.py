"""Offload, step cache and VAE tiling through the real build path on the embedded tiny model."""
from __future__ import annotations

import pytest
import torch

from omni.engine import Engine
from omni.platform_manager import select
from omni.recipe import RecipeError, load_recipe
from omni.request import ImageRequest
from omni.models.hunyuan_image3.build import build_pipeline

STEPS = 4


def generate(overrides: dict, ckpt, **req):
    recipe = load_recipe("cpu_tiny").replace_paths(overrides) if overrides else load_recipe("cpu_tiny")
    pipe = build_pipeline(recipe, select("cpu"), progress=False, cache_dir=ckpt)
    out = Engine(pipe).run([ImageRequest(prompt="a red cat", height=512, width=512, steps=STEPS, seed=7, **req)])[0]
    return torch.from_numpy(out.image_HW3).float(), out, pipe


def psnr(a, b) -> float:
    mse = ((a - b) ** 2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(255.0 ** 2 / mse)).item()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny") / "ckpt"  # generated once, reused by every test here


@pytest.fixture(scope="module")
def baseline(ckpt):
    return generate({}, ckpt)[0]


@pytest.mark.parametrize("mode, extra", [("layers", {"offload.resident_layers": 1, "offload.prefetch_window": 1}),
                                         ("layers", {"offload.prefetch_window": 2}), ("experts", {}),
                                         ("text", {}), ("vae", {})])
def test_offload_modes_give_the_resident_image(baseline, ckpt, mode, extra):
    img, _, pipe = generate({"offload.mode": mode, **extra}, ckpt)
    assert torch.equal(img, baseline)
    if mode in ("layers", "experts", "vae"):
        assert pipe.offloaders and pipe.offloaders[0].stats.copies > 0


def test_streamed_offload_builds_one_layer_at_a_time(baseline, ckpt, monkeypatch):
    """offload.mode experts/layers loads and prepares a layer at a time: later layers are still meta."""
    from omni.weights import StreamingLoad

    seen, load = [], StreamingLoad.load

    def spy(self, select, progress=False):
        layers = self.loader.targets[0].module.model.layers
        seen.append([all(p.is_meta for p in layer.parameters()) for layer in layers])
        return load(self, select, progress)

    monkeypatch.setattr(StreamingLoad, "load", spy)
    img, _, pipe = generate({"offload.mode": "experts", "offload.resident_layers": 1}, ckpt)
    n = len(pipe.model.transformer.model.layers)
    assert seen[:n] == [[j > i for j in range(n)] for i in range(n)]
    assert pipe.model.vae.encoder is None  # text-to-image never encodes
    assert torch.equal(img, baseline)


def test_step_cache_skips_middle_steps_and_reports_them(baseline, ckpt):
    off, res_off, _ = generate({}, ckpt, step_cache=0.0)
    assert torch.equal(off, baseline) and res_off.times.steps_skipped == 0
    img, res, _ = generate({}, ckpt, step_cache=10.0)  # a threshold nothing crosses: every middle step skips
    assert res.times.steps_skipped == STEPS - 2  # the first and the last step always run
    assert not torch.equal(img, baseline)
    mild, res_mild, _ = generate({"step_cache.enabled": True, "step_cache.threshold": 0.3}, ckpt)
    assert 0 <= res_mild.times.steps_skipped <= STEPS - 2
    assert psnr(mild, baseline) >= psnr(img, baseline)  # skipping less stays closer


def test_tiled_decode_is_close_to_untiled(baseline, ckpt):
    img, _, _ = generate({"vae.tiling": True, "vae.tile_latents": 16, "vae.overlap": 8}, ckpt)
    assert img.shape == baseline.shape and psnr(img, baseline) > 25.0


def test_offload_with_graph_capture_is_refused_naming_both():
    with pytest.raises(RecipeError, match=r"offload\.mode=layers conflicts with graph\.mode=capture"):
        load_recipe("cpu_tiny").replace_paths({"offload.mode": "layers", "graph.mode": "capture"})
