"""``device.expandable_segments``: the caching allocator grows its segments in place.

On the H200 the ``h200_fp8`` headline held 8.8 GiB less reserved memory with it at the same speed
(BENCHMARKS.md, "Twenty-fifth session"). The setting is process-wide and applies to segments reserved after
it, so the build sets it first, before any weight is on the device; an operator's own allocator settings
(``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` naming ``expandable_segments``) win over the recipe.
``tests/gpu/test_gpu_allocator.py`` checks on a GPU that the segments really are expandable and that a graph
captures and replays under them.
"""
from __future__ import annotations

import logging

import pytest
import torch

from omni.device import DeviceServices
from omni.platform_manager import select
from omni.recipe import RecipeError, load_recipe


def _build_recording(monkeypatch, expandable: bool) -> list[str]:
    """Build cpu_tiny with the setting on or off; the order in which the device was set up and filled."""
    from omni.models.hunyuan_image3 import build

    events: list[str] = []
    real_load = build.load_weights
    real_setting = DeviceServices.expandable_segments
    monkeypatch.setattr(DeviceServices, "expandable_segments",
                        lambda self: (events.append("expandable_segments"), real_setting(self))[1])
    monkeypatch.setattr(build, "load_weights", lambda *a, **k: (events.append("load_weights"), real_load(*a, **k))[1])
    recipe = load_recipe("cpu_tiny").replace_paths({"device.expandable_segments": expandable})
    build.build_pipeline(recipe, select("cpu"), progress=False)
    return events


@torch.inference_mode()
def test_the_build_sets_expandable_segments_before_any_weight_is_loaded(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="omni.hunyuan_image3"):
        events = _build_recording(monkeypatch, expandable=True)
    assert events == ["expandable_segments", "load_weights"]
    assert "expandable allocator segments: no caching allocator on the cpu" in caplog.text


@torch.inference_mode()
def test_the_allocator_is_left_alone_by_default(monkeypatch):
    assert load_recipe("cpu_tiny").device.expandable_segments is False
    assert _build_recording(monkeypatch, expandable=False) == ["load_weights"]


@pytest.mark.parametrize("var", ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"])
def test_the_operators_allocator_settings_win(monkeypatch, var):
    """Both names torch reads; the recipe's setting is not applied over them (no device is touched)."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv(var, "max_split_size_mb:512,expandable_segments:False")
    assert DeviceServices("cuda").expandable_segments() == \
        f"left to {var}=max_split_size_mb:512,expandable_segments:False"


def test_a_setting_of_other_keys_does_not_count_as_the_operators_word(monkeypatch):
    """The environment names other keys only, so the setting goes on to torch: here a torch with neither setter,
    which is refused naming the field."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", None)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", None)
    with pytest.raises(RuntimeError, match=r"device.expandable_segments: torch .* cannot set the cuda allocator"):
        DeviceServices("cuda").expandable_segments()


def test_a_torch_older_than_2_9_sets_it_through_the_device_module(monkeypatch):
    """Before torch 2.9 there is no accelerator-wide setter; torch.cuda's own (since 2.1) takes the same string.
    (Recorded here: the CPU build cannot reach a CUDA allocator.)"""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", None)
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    assert DeviceServices("cuda").expandable_segments() == "set"
    assert calls == ["expandable_segments:True"]


def test_the_recipe_field_takes_booleans_only():
    with pytest.raises(RecipeError, match="device.expandable_segments"):
        load_recipe("cpu_tiny").replace_paths({"device.expandable_segments": "sometimes"})
    assert load_recipe("h200_fp8").device.expandable_segments is True  # measured there (BENCHMARKS.md)
