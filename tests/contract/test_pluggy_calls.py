"""Hooks are real pluggy calls, the vendor modules are typed, and a broken platform package breaks nothing else.

- wrappers (``@hookimpl(wrapper=True)``) and call monitoring registered on
  ``Platform.pm`` see factory calls, while refusals stay attributed to
  their plugin;
- every shipped vendor platform's modules satisfy ``omni.platform_parts``;
- an installed distribution whose ``omni.platforms`` entry point fails to
  import is listed with its error and never selected (a real entry point in
  a temporary folder on ``PYTHONPATH``, run through the CLI in a subprocess).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import subprocess
import sys
import types
from importlib import resources

import pytest
import torch

from omni import platform_manager, platform_parts
from omni.hookspecs import hookimpl
from omni.platform_manager import NoImplementationError, Platform, PlatformError
from omni.reference import ReferenceAttention
from omni.specs import (AttentionSpec, CaptureSpec, CollectiveSpec, GemmSpec, GroupedGemmSpec, MoESpec,
                        PlatformInfo)

ATTENTION = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, mask="causal")
NVFP4 = GemmSpec(in_features=64, out_features=64, dtype=torch.bfloat16, quant="nvfp4")
VENDORS = ("cuda", "rocm", "npu", "xpu", "musa")
MISSING_RUNTIME = "broken_plat_missing_runtime"
IMPORT_ERROR = f"import failed: ModuleNotFoundError: No module named '{MISSING_RUNTIME}'"


class Tracer:
    """An ordinary third-party wrapper: sees the spec going in and the implementation coming out."""

    def __init__(self):
        self.seen: list[tuple[object, object]] = []

    @hookimpl(wrapper=True)
    def omni_attention_impl(self, spec):
        result = yield
        self.seen.append((spec, result))
        return result

    @hookimpl(wrapper=True)
    def omni_linear_impl(self, spec):
        result = yield
        self.seen.append((spec, result))
        return result


class Shy:
    """A platform that declines every linear with a known reason."""

    @hookimpl
    def omni_linear_impl(self, spec, reject):
        reject("shy: no linear here")


# ----------------------------------------------------------------- pluggy calls


def test_a_wrapper_sees_the_spec_and_the_result():
    platform = platform_manager.select("cpu")
    tracer = Tracer()
    platform.pm.register(tracer)
    impl = platform.attention(ATTENTION)
    assert isinstance(impl, ReferenceAttention) and not inspect.isgenerator(impl)
    assert tracer.seen == [(ATTENTION, impl)]
    assert platform.attention(ATTENTION) is impl and len(tracer.seen) == 1, "resolved once per spec"


def test_call_monitoring_sees_every_factory_call():
    platform = platform_manager.select("cpu")
    before, after = [], []
    platform.pm.add_hookcall_monitoring(lambda name, impls, kwargs: before.append((name, kwargs["spec"])),
                                        lambda outcome, name, impls, kwargs: after.append(name))
    grouped = GroupedGemmSpec(num_experts=2, in_features=16, out_features=8, dtype=torch.float32)
    moe = MoESpec(num_experts=2, topk=1, hidden=16, inner=8, dtype=torch.float32)
    capture = CaptureSpec(device_type="cpu", name="step")
    collective = CollectiveSpec(axis="tp", world_size=2, device_type="cpu")
    platform.attention(ATTENTION)
    platform.linear(GemmSpec(in_features=16, out_features=8, dtype=torch.float32))
    platform.grouped_gemm(grouped)
    platform.moe(moe)
    assert platform.communicator(collective, group=None) is None, "the reference leaves collectives to torch"
    with pytest.raises(NoImplementationError, match="reference: runs eagerly"):
        platform.graph_runner(capture)
    factories = ["omni_attention_impl", "omni_linear_impl", "omni_grouped_gemm_impl", "omni_moe_impl",
                 "omni_communicator_impl", "omni_graph_runner_impl"]
    assert [name for name, _ in before] == factories and after == factories
    assert (before[2][1], before[3][1], before[4][1], before[5][1]) == (grouped, moe, collective, capture)


def test_refusals_stay_attributed_through_pluggy_with_a_wrapper_in_the_way():
    platform = Platform(PlatformInfo(name="shy", device_type="cpu", dist_backend="gloo"), Shy())
    tracer = Tracer()
    platform.pm.register(tracer, name="tracer")
    with pytest.raises(NoImplementationError) as err:
        platform.linear(NVFP4)
    assert [p for p, _ in err.value.reasons] == ["shy", "cpu"]
    assert err.value.reasons[0] == ("shy", "shy: no linear here")
    assert "\n  - shy: shy: no linear here\n  - cpu: reference: quant 'nvfp4'" in str(err.value)
    assert tracer.seen == [(NVFP4, None)], "the wrapper saw the unanswered call; the host raised after it"


class Blunt:
    """A third-party plugin registered on ``pm`` directly (not through the adapter) that declines."""

    @hookimpl(tryfirst=True)
    def omni_linear_impl(self, spec, reject):
        reject("blunt: no")


def test_a_refusal_from_a_plugin_registered_directly_is_kept_unattributed():
    platform = platform_manager.select("cpu")
    platform.pm.register(Blunt(), name="blunt")
    with pytest.raises(NoImplementationError) as err:
        platform.linear(NVFP4)
    assert err.value.reasons[0] == (platform_manager.UNATTRIBUTED, "blunt: no")
    assert [p for p, _ in err.value.reasons[1:]] == ["cpu"]


def test_the_reference_stays_trylast_and_the_platform_keeps_its_name():
    platform = Platform(PlatformInfo(name="shy", device_type="cpu", dist_backend="gloo"), Shy())
    impls = platform.pm.hook.omni_linear_impl.get_hookimpls()  # pluggy calls them last to first
    assert [(i.plugin_name, i.trylast) for i in impls] == [("cpu", True), ("shy", False)]


def test_check_recipe_still_returns_plain_reasons():
    recipe = types.SimpleNamespace(quant=types.SimpleNamespace(scheme="nvfp4"))
    reasons = platform_manager.select("cpu").check_recipe(recipe)
    assert len(reasons) == 1 and reasons[0].startswith("quant.scheme=nvfp4: the reference (cpu) platform")


# ----------------------------------------------------------------- typed vendor modules

PARTS = {"capabilities": platform_parts.CapabilitiesModule, "attention": platform_parts.AttentionModule,
         "gemm": platform_parts.GemmModule, "moe": platform_parts.MoEModule, "glue": platform_parts.GlueModule}


def _protocol_methods(protocol) -> dict[str, int]:
    """Each method of ``protocol`` and how many positional arguments a module's function is called with."""
    return {name: len(inspect.signature(fn).parameters) - 1  # less ``self``
            for name, fn in vars(protocol).items() if inspect.isfunction(fn) and not name.startswith("_")}


@pytest.mark.parametrize("vendor", VENDORS)
def test_vendor_modules_satisfy_the_protocols(vendor):
    plugin = importlib.import_module(f"omni.platforms.{vendor}.plugin").plugin
    for part, protocol in PARTS.items():
        module = getattr(plugin, part)
        if module is None and part in ("moe", "glue"):
            continue  # optional: grouped GEMMs are composed / the reference's glue ops run
        assert isinstance(module, protocol), f"{vendor}.{part} is not a {protocol.__name__}"
        for name, arity in _protocol_methods(protocol).items():
            inspect.signature(getattr(module, name)).bind(*[None] * arity)  # callable as the shared hooks call it


def test_the_protocols_refuse_a_module_missing_a_function():
    incomplete = types.ModuleType("incomplete_gemm")
    incomplete.resolve_linear = lambda spec, caps, reject: None
    assert not isinstance(incomplete, platform_parts.GemmModule)


# ----------------------------------------------------------------- a real broken entry point


@pytest.fixture
def broken_dist(tmp_path):
    """A folder holding an installed-looking distribution whose platform module fails to import."""
    site = tmp_path / "site"
    info = site / "broken_plat-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken_plat\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[omni.platforms]\nbroken = broken_plat_mod:plugin\n")
    (site / "broken_plat_mod.py").write_text(f"import {MISSING_RUNTIME}  # the vendor runtime is not installed\n"
                                             "plugin = object()\n")
    return site


@pytest.fixture
def broken_installed(broken_dist, monkeypatch):
    monkeypatch.syspath_prepend(str(broken_dist))
    return broken_dist


def test_discovery_lists_the_broken_platform_with_its_error(broken_installed):
    detections = {d.name: d for d in platform_manager.detect_all()}
    assert detections["broken"].info is None and detections["broken"].reasons == [IMPORT_ERROR]
    assert detections["cpu"].info is not None and {"cuda", "rocm", "npu", "xpu", "musa"} <= set(detections)


def test_selection_names_the_import_error_and_ignores_it_for_the_rest(broken_installed):
    with pytest.raises(PlatformError, match=re.escape(f"platform 'broken' is not usable here: {IMPORT_ERROR}")):
        platform_manager.select("broken")
    assert platform_manager.select("cpu").name == "cpu"
    try:
        assert platform_manager.select("cuda").name == "cuda"
    except PlatformError as e:  # a box without CUDA: refused for its own reason, not the broken package's
        assert str(e).startswith("platform 'cuda' is not usable here: cuda: "), e


def test_auto_ignores_the_broken_platform_but_mentions_it(broken_installed, monkeypatch):
    monkeypatch.setattr(platform_manager, "detect", _only_broken_refuses(platform_manager.detect))
    with pytest.raises(PlatformError) as err:
        platform_manager.select("auto")
    assert "found no accelerator" in str(err.value) and f"broken: {IMPORT_ERROR}" in str(err.value)


def _only_broken_refuses(detect):
    """Detection with every real vendor reported absent, whatever this box has."""
    def fake(name, plugin):
        return detect(name, plugin) if name in ("broken", "cpu") else platform_manager.Detection(name, None, [])
    return fake


def _any_platform_recipe(folder):
    """The default recipe with ``platform: auto``, so ``--platform broken`` reaches selection (no recipe conflict)."""
    text = resources.files("omni.recipes").joinpath("cpu_tiny.yaml").read_text(encoding="utf-8")
    assert "\nplatform: cpu\n" in text
    path = folder / "tiny_any_platform.yaml"
    path.write_text(text.replace("\nplatform: cpu\n", "\nplatform: auto\n"), encoding="utf-8")
    return path


def _omni_run(broken_dist, cwd, *argv) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(broken_dist), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "omni.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": path})


def test_omni_run_platforms_lists_the_broken_one(broken_dist, tmp_path):
    run = _omni_run(broken_dist, tmp_path, "platforms")
    assert run.returncode == 0, run.stderr
    row = next(line for line in run.stdout.splitlines() if line.startswith("broken "))
    assert row.split()[1] == "no" and IMPORT_ERROR in row
    assert any(line.startswith("cpu ") and " yes " in line for line in run.stdout.splitlines())


def test_omni_run_generate_on_cpu_is_unaffected_and_broken_is_refused(broken_dist, tmp_path):
    run = _omni_run(broken_dist, tmp_path, "generate", "--platform", "cpu", "--prompt", "x", "--steps", "1",
                    "--size", "128x128", "-o", "out.png")
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "out.png").stat().st_size > 0
    refused = _omni_run(broken_dist, tmp_path, "generate", "--recipe", str(_any_platform_recipe(tmp_path)),
                        "--platform", "broken", "--prompt", "x", "--steps", "1", "--size", "1024x1024",
                        "-o", "refused.png")
    assert refused.returncode == 2, refused.stderr
    assert f"omni-run: error: platform 'broken' is not usable here: {IMPORT_ERROR}" in refused.stderr
    assert not (tmp_path / "refused.png").exists()
