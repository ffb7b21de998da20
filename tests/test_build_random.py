"""``build_pipeline(random_layers=N)``: the benchmark build (``omni-run bench --full-size-layers N``).

It must build exactly as a checkpoint does (meta modules, one layer at a time
given storage, filled, prepared for its kernels) with random values in place
of the load. On the CPU the released widths are too large for the suite, so
``released_layers`` is swapped for the embedded tiny widths: the build path
is the one the H200 bench runs (BENCHMARKS.md, the issue-17 headline).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omni.platform_manager import select
from omni.recipe import load_recipe
from omni.request import ImageRequest


def _swap_widths(monkeypatch, kind: str = "base"):
    """``released_layers`` -> the tiny checkpoint's widths of ``kind`` (the build path is unchanged)."""
    from omni.models.hunyuan_image3 import build
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.tiny import ensure_tiny_checkpoint

    tiny = HunyuanImage3Config.from_file(ensure_tiny_checkpoint(kind=kind) / "config.json")

    def layers(n):
        return dataclasses.replace(tiny, num_hidden_layers=n, moe_topk=(tiny.moe_topk[0],) * n,
                                   moe_intermediate_size=(tiny.moe_intermediate_size[0],) * n,
                                   num_shared_expert=(tiny.num_shared_expert[0],) * n)
    monkeypatch.setattr(build, "released_layers", layers)
    return build


@pytest.fixture
def tiny_widths(monkeypatch):
    return _swap_widths(monkeypatch)


@torch.inference_mode()
def test_random_layers_build_layer_by_layer_and_generate(tiny_widths):
    recipe = load_recipe("cpu_tiny").replace_paths({"quant.scheme": "fp8_row"})
    engine = tiny_widths.build_pipeline(recipe, select("cpu"), random_layers=3, progress=False)
    layers = engine.model.transformer.model.layers
    assert len(layers) == 3
    w = [layer.mlp.experts.gate_and_up_proj for layer in layers]
    assert all(g.weight.dtype == torch.float8_e4m3fn and g.prepared is not None for g in w), "quantized per layer"
    assert not torch.equal(w[0].weight.float(), w[1].weight.float()), "each layer gets its own values"
    assert all(not p.is_meta for p in engine.model.transformer.parameters())
    norms = [layer.input_layernorm.weight for layer in layers]
    assert all(torch.equal(n, torch.ones_like(n)) for n in norms)
    vae = engine.model.vae.decoder.conv_in.weight
    assert vae.float().std() > 0, "the VAE is filled too (the image's last stage)"
    s = engine.admit(ImageRequest(prompt="a red cat", height=1024, width=1024, steps=2, guidance=5.0, seed=0))
    before = s.latents_1Chw.clone()
    engine.prefill([s])
    engine.denoise_step([s])  # one step through the random layers: finite and moved
    assert torch.isfinite(s.latents_1Chw).all() and not torch.equal(s.latents_1Chw, before)
    engine.release(s)


@pytest.mark.parametrize("flavor,pipeline,rows", [
    ("hunyuan_image3_instruct", "HunyuanImage3Instruct", 2),
    ("hunyuan_image3_instruct_distil", "HunyuanImage3InstructDistil", 1),
])
@torch.inference_mode()
def test_instruct_and_distil_random_builds_draw_through_their_pipelines(monkeypatch, flavor, pipeline, rows):
    """The Instruct releases' random builds: their pipeline class, their encoders filled, Distil's extra
    embeddings present, one text-to-image step through them (CFG pair for Instruct, one row for Distil)."""
    build = _swap_widths(monkeypatch, "instruct_trained")
    recipe = load_recipe("cpu_tiny_instruct").replace_paths({"model.flavor": flavor})
    engine = build.build_pipeline(recipe, select("cpu"), random_layers=2, progress=False)
    assert type(engine.model).__name__ == pipeline and len(engine.model.transformer.model.layers) == 2
    cfg = engine.model.transformer.cfg
    assert (cfg.cfg_distilled and cfg.use_meanflow) == (pipeline.endswith("Distil"))
    assert engine.model.vision is not None and engine.model.vae.encoder is not None, "editing parts built too"
    assert all(not p.is_meta for p in engine.model.vision.parameters())
    s = engine.admit(ImageRequest(prompt="a red cat", height=256, width=256, steps=2, guidance=5.0, seed=0,
                                  template="instruct"))
    assert len(s.rows) == rows
    before = s.latents_1Chw.clone()
    engine.prefill([s])
    engine.denoise_step([s])
    assert torch.isfinite(s.latents_1Chw).all() and not torch.equal(s.latents_1Chw, before)
    engine.release(s)


def test_distil_deployment_schedules_its_default_request(monkeypatch):
    """The scheduler sizes the recipe's default request at startup with the recipe's template: a Distil
    deployment (which refuses the pretrain template) starts."""
    from omni.scheduler import Scheduler

    build = _swap_widths(monkeypatch, "instruct_trained")
    recipe = load_recipe("cpu_tiny_instruct").replace_paths({"model.flavor": "hunyuan_image3_instruct_distil",
                                                             "defaults.size": "256x256"})
    engine = build.build_pipeline(recipe, select("cpu"), random_layers=1, progress=False)
    sched = Scheduler.from_recipe(engine, recipe)
    assert sched.cost(ImageRequest(prompt="x", height=256, width=256, template="instruct")).step_tokens > 0


def test_random_build_names_the_flavours_it_knows():
    from omni.models.hunyuan_image3.build import random_release

    from omni.model_registry import ModelError

    with pytest.raises(ModelError, match="unknown model flavor 'sdxl'; registered: .*hunyuan_image3_instruct_distil"):
        random_release("sdxl", 2)


@torch.inference_mode()
def test_build_returns_the_loads_cached_memory_before_the_kv_pool(tiny_widths, monkeypatch):
    """The load's freed temporaries go back to the device (``empty_cache``) once every layer is in place and
    before the KV pool is allocated: on the H200 they held 10.7-15.4 GiB of cache after a 32-layer build."""
    events, real_bind, real_pool = [], tiny_widths._bind_device, tiny_widths._kv_pool

    def bind(recipe, platform, local_rank):
        services = real_bind(recipe, platform, local_rank)
        release = services.empty_cache
        monkeypatch.setattr(services, "empty_cache", lambda: (events.append("empty_cache"), release())[1])
        return services

    monkeypatch.setattr(tiny_widths, "_bind_device", bind)
    monkeypatch.setattr(tiny_widths, "_kv_pool", lambda *a: (events.append("kv_pool"), real_pool(*a))[1])
    tiny_widths.build_pipeline(load_recipe("cpu_tiny"), select("cpu"), random_layers=2, progress=False)
    assert events == ["empty_cache", "kv_pool"]


def test_bench_full_size_layers_builds_random_layers_then_warms_up_as_serve(tiny_widths, tmp_path):
    """``omni-run bench --full-size-layers N`` goes through ``open_engine`` as ``serve`` does: the random build
    (N layers here), then the server's warm-up, both inside ``time_to_ready_s``."""
    import json

    from omni.bench_client import bench_main

    asked, layers = [], tiny_widths.released_layers
    tiny_widths.released_layers = lambda n: (asked.append(n), layers(n))[1]  # tiny_widths' monkeypatch restores
    out = tmp_path / "bench.json"
    assert bench_main(["--recipe", "cpu_tiny", "--full-size-layers", "2", "--concurrency", "1", "--requests", "1",
                       "--steps", "1", "--sizes", "256x256", "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert asked == [2] and report["levels"][0]["ok"] == 1
    assert report["ready"]["warm_up_s"] > 0 and report["ready"]["build_s"] > 0
