"""How kernels are resolved: refusals carry reasons, errors list every plugin, trace and cache."""
from __future__ import annotations

import logging

import pytest
import torch

from conformance_cases import (PROVIDERS, attention_spec, device_of, get_platform, register_platform_provider,
                               unregister_platform_provider)
from omni.hookspecs import hookimpl
from omni.platform_manager import NoImplementationError, Platform
from omni.specs import GemmSpec, GroupedGemmSpec, PlatformInfo

NVFP4 = GemmSpec(in_features=64, out_features=64, dtype=torch.bfloat16, quant="nvfp4")
NVFP4_GROUPED = GroupedGemmSpec(num_experts=2, in_features=64, out_features=64,
                                dtype=torch.bfloat16, quant="nvfp4")


class Shy:
    """A platform that declines every kernel with a known reason."""

    @hookimpl
    def omni_attention_impl(self, spec, reject):
        reject("shy: attention is not my thing")

    @hookimpl
    def omni_linear_impl(self, spec, reject):
        reject("shy: no linear either")


def shy_platform(trace=False) -> Platform:
    info = PlatformInfo(name="shy", device_type="cpu", dist_backend="gloo")
    return Platform(info, Shy(), trace=trace)


@pytest.mark.parametrize("spec,factory", [(NVFP4, "linear"), (NVFP4_GROUPED, "grouped_gemm")],
                         ids=["linear", "grouped"])
def test_no_implementation_lists_each_plugin_reason(platform_name, spec, factory):
    platform = get_platform(platform_name)
    with pytest.raises(NoImplementationError) as err:
        getattr(platform, factory)(spec)
    plugins = [p for p, _ in err.value.reasons]
    assert "cpu" in plugins and (platform_name == "cpu" or platform_name in plugins)
    for plugin, reason in err.value.reasons:
        assert reason and f"{plugin}: {reason}" in str(err.value)
    assert "nvfp4" in str(err.value)


def test_refusals_are_collected_from_a_declining_platform():
    with pytest.raises(NoImplementationError) as err:
        shy_platform().linear(NVFP4)
    assert err.value.reasons[0] == ("shy", "shy: no linear either")
    assert [p for p, _ in err.value.reasons] == ["shy", "cpu"]


def test_trace_names_the_answering_plugin_and_who_declined(caplog):
    caplog.set_level(logging.INFO, logger="omni.platforms")
    impl = shy_platform(trace=True).attention(attention_spec("fp32", 64, 1, "none", 0))
    line = next(r.getMessage() for r in caplog.records if "omni_attention_impl" in r.getMessage())
    assert f"-> cpu: {impl.name}" in line and "[shy declined: shy: attention is not my thing]" in line


def test_trace_on_the_platform_under_test(platform_name, caplog):
    from omni import platform_manager

    caplog.set_level(logging.INFO, logger="omni.platforms")
    platform = platform_manager.select(platform_name, trace=True)
    impl = platform.attention(attention_spec("bf16", 64, 4, "causal", 0))
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"-> {platform_name}: {impl.name}" in m for m in messages), messages


def test_resolution_is_cached_per_spec(platform_name):
    platform = get_platform(platform_name)
    a = platform.attention(attention_spec("bf16", 64, 4, "causal", 0))
    assert platform.attention(attention_spec("bf16", 64, 4, "causal", 0)) is a
    assert platform.attention(attention_spec("bf16", 64, 4, "none", 0)) is not a
    spec = GemmSpec(in_features=64, out_features=32, dtype=torch.bfloat16)
    assert platform.linear(spec) is platform.linear(GemmSpec(in_features=64, out_features=32,
                                                             dtype=torch.bfloat16))


def test_platform_info(platform_name):
    info = get_platform(platform_name).info
    assert info.name == platform_name
    if platform_name == "cuda":
        assert (info.device_type, info.dist_backend, info.accelerator) == ("cuda", "nccl", True)
        assert "graphs" in info.capabilities and info.device_count >= 1 and info.memory_bytes > 0


def test_a_registered_provider_supplies_the_platform_uncached():
    """Another suite (tests/contract) can put its own, e.g. double-backed, platform under these tests."""
    built: list[Platform] = []

    def provider() -> Platform:
        built.append(shy_platform())
        return built[-1]

    register_platform_provider("shy", provider)
    try:
        assert get_platform("shy") is built[0] and get_platform("shy") is built[1], "asked every time, never cached"
        assert device_of("shy") == "cpu"
    finally:
        unregister_platform_provider("shy")
    assert "shy" not in PROVIDERS
