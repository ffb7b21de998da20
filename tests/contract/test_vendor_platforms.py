"""Vendor platform hygiene, detection, services and recipe checks, over the doubles.

- importing the plugins has no side effects (no vendor import, no device init, no torch flag);
- every hook implementation is at most 30 lines and is a documented hook;
- on this CPU machine each vendor refuses with a reason naming itself;
- with the doubles, detection finds the device without one call that would
  create a device context, turns an ``ImportError`` into a reason and lets
  any unexpected exception through;
- collectives backend, device binding, graph capture/replay and recipe
  refusals behave as documented.
"""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from vendor_cases import DEFAULT_VARIANT, PLUGINS, VARIANTS, build_vendor, variant_params
from doubles.device import install_broken, vendor_module
from doubles.ipex import install_xpu
from doubles.torch_musa import install_musa
from doubles.torch_npu import install_npu
from omni import platform_manager
from omni.recipe import load_recipe
from omni.specs import CaptureSpec, PlatformInfo

BACKENDS = {"rocm": "nccl", "npu": "hccl", "xpu": "xccl", "musa": "mccl"}
DEVICE_TYPES = {"rocm": "cuda", "npu": "npu", "xpu": "xpu", "musa": "musa"}
NAMES = [pytest.param(n, marks=getattr(pytest.mark, n)) for n in PLUGINS]


def test_importing_the_plugins_has_no_side_effects():
    code = (
        "import sys, torch\n"
        "flags = lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,\n"
        "                 torch.get_float32_matmul_precision(), torch.get_default_dtype())\n"
        "before = flags()\n"
        "import omni.platforms.rocm.plugin, omni.platforms.npu.plugin, "
        "omni.platforms.xpu.plugin, omni.platforms.musa.plugin\n"
        "vendor = ('torch_npu', 'torch_musa', 'aiter', 'intel_extension_for_pytorch', 'flash_attn_interface',\n"
        "          'oneccl_bindings_for_pytorch')\n"
        "assert not [m for m in vendor if m in sys.modules], [m for m in vendor if m in sys.modules]\n"
        "assert not hasattr(torch, 'npu') and not hasattr(torch, 'musa'), 'a device module was registered'\n"
        "assert not torch.cuda.is_initialized() and not torch.xpu.is_initialized(), 'a device was initialised'\n"
        "assert flags() == before, (before, flags())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", NAMES)
def test_hookimpls_are_short_and_documented_hooks(name):
    hooks = [(n, f) for n, f in inspect.getmembers(PLUGINS[name], inspect.isfunction) if hasattr(f, "omni_impl")]
    assert {"omni_platform_detect", "omni_attention_impl", "omni_graph_runner_impl"} <= {n for n, _ in hooks}
    for hook_name, fn in hooks:
        lines = len(inspect.getsourcelines(fn)[0])
        assert lines <= 30, f"{name}.{hook_name} is {lines} lines"
    # check_pending: every hookimpl matches a hookspec
    platform_manager.Platform(PlatformInfo(name=name, device_type="cpu", dist_backend="gloo"), PLUGINS[name]())


@pytest.mark.parametrize("name", NAMES)
def test_without_the_hardware_detection_refuses_with_a_reason(name):
    det = platform_manager.detect(name, PLUGINS[name]())
    assert det.info is None and det.reasons and all(r.startswith(f"{name}: ") for r in det.reasons), det.reasons


@pytest.mark.parametrize("variant", variant_params())
def test_detection_makes_no_device_context_call(variant, monkeypatch):
    name, install = VARIANTS[variant]
    doubles = install(monkeypatch)
    det = platform_manager.detect(name, PLUGINS[name]())
    info = det.info
    assert (info.name, info.device_type, info.dist_backend, info.accelerator) == (name, DEVICE_TYPES[name],
                                                                                  BACKENDS[name], True)
    assert info.device_count == doubles.device.count
    assert doubles.device.context_calls() == [], "detection must not create a device context"


@pytest.mark.parametrize("name,module,message,reason", [
    pytest.param("npu", "torch_npu", "libhccl.so: cannot open shared object file", "set_env.sh", marks=pytest.mark.npu),
    pytest.param("musa", "torch_musa", "libmusart.so: cannot open shared object file", "MUSA SDK",
                 marks=pytest.mark.musa),
])
def test_detection_turns_an_import_error_into_a_reason(name, module, message, reason, monkeypatch):
    install_broken(monkeypatch, module, ImportError(message))
    det = platform_manager.detect(name, PLUGINS[name]())
    assert det.info is None and message in det.reasons[0] and reason in det.reasons[0], det.reasons


class Unexpected(Exception):
    pass


@pytest.mark.parametrize("variant", variant_params())
def test_detection_lets_unexpected_errors_through(variant, monkeypatch):
    name, install = VARIANTS[variant]
    install(monkeypatch)

    def broken(*args):
        raise Unexpected("driver exploded")

    device_module = {"rocm": torch.cuda, "xpu": torch.xpu}.get(name) or getattr(torch, name)
    for probe in ("is_available", "device_count"):
        monkeypatch.setattr(device_module, probe, broken)
    with pytest.raises(Unexpected):
        platform_manager.detect(name, PLUGINS[name]())


def test_select_finds_a_vendor_through_its_entry_point(monkeypatch):
    install_npu(monkeypatch)
    platform = platform_manager.select("npu")
    assert platform.info.name == "npu" and platform.dist_backend() == "hccl"


def test_auto_selection_finds_the_one_vendor_present(monkeypatch):
    install_musa(monkeypatch)
    assert platform_manager.select("auto").info.name == "musa"


# ----------------------------------------------------------------- services


def test_configure_binds_the_local_rank(vendor):
    vendor.platform.device_services(3)
    assert vendor.doubles.device.current == 3


def test_dist_backend(vendor):
    assert vendor.platform.dist_backend() == BACKENDS[vendor.name]


@pytest.mark.xpu
def test_xpu_falls_back_to_oneccl_without_xccl(monkeypatch):
    install_xpu(monkeypatch, xccl=False)
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", vendor_module("oneccl_bindings_for_pytorch"))
    vendor = platform_manager.select("xpu")
    assert vendor.dist_backend() == "ccl"
    vendor.device_services(0)  # configure imports the bindings (registers "ccl"); the double is already there


def test_graph_runner_captures_once_and_replays(vendor):
    device = vendor.doubles.device
    spec = CaptureSpec(device_type=vendor.platform.info.device_type, name="step[64x2]", pool_id=7)
    runner = vendor.platform.graph_runner(spec)
    assert runner.name.startswith(("hip-graph", "npu-graph", "xpu-graph", "musa-graph"))
    seen = []
    out = runner.capture(lambda: seen.append(device.capturing) or torch.ones(2))
    assert seen == [False, False, True], "two warm-up runs outside the capture, then one inside"
    runner.replay()
    runner.replay()
    assert device.graphs[-1].replays == 2 and torch.equal(out, torch.ones(2))
    other = vendor.platform.graph_runner(spec)
    other.capture(lambda: None)
    assert device.pools[-1] == device.pools[-2], "regions with one pool_id share a pool"


@pytest.mark.parametrize("variant,install,reason", [
    pytest.param("npu", lambda mp: install_npu(mp, graphs=False), "NPUGraph is missing", marks=pytest.mark.npu),
    pytest.param("xpu", lambda mp: install_xpu(mp, graphs=False), "XPUGraph is missing", marks=pytest.mark.xpu),
    pytest.param("musa", lambda mp: install_musa(mp, graphs=False), "MUSAGraph is missing", marks=pytest.mark.musa),
])
def test_graph_capture_refused_without_a_graph_class(variant, install, reason, monkeypatch):
    install(monkeypatch)
    plugin = PLUGINS[variant]()
    plugin.device_caps()
    reasons: list[str] = []
    spec = CaptureSpec(device_type=DEVICE_TYPES[variant], name="step")
    assert plugin.omni_graph_runner_impl(spec=spec, reject=reasons.append) is None
    assert reason in reasons[0]
    assert plugin.omni_graph_runner_impl(spec=CaptureSpec(device_type="cpu", name="x"), reject=reasons.append) is None
    assert "cannot capture a 'cpu' region" in reasons[-1]


# ----------------------------------------------------------------- recipe checks


@pytest.mark.parametrize("variant,install,changes,reason", [
    pytest.param("rocm", None, {"attention.backend": "fia"}, "rocm: attention.backend=fia is not a rocm backend",
                 marks=pytest.mark.rocm),
    pytest.param("npu", None, {"attention.backend": "fia", "kv_cache.page_tokens": 16},
                 "FIA paged KV needs a multiple of 128", marks=pytest.mark.npu),
    pytest.param("npu", lambda mp: install_npu(mp, graphs=False), {"graph.mode": "capture"},
                 "npu: graph.mode=capture needs torch.npu.NPUGraph", marks=pytest.mark.npu),
    pytest.param("xpu", lambda mp: install_xpu(mp, xccl=False), {"parallel.tp": 2, "device.count": 2},
                 "needs XCCL", marks=pytest.mark.xpu),
    pytest.param("xpu", lambda mp: install_xpu(mp, graphs=False), {"graph.mode": "capture"}, "XPUGraph",
                 marks=pytest.mark.xpu),
    pytest.param("musa", None, {"attention.backend": "fa3"}, "musa: paged KV unsupported", marks=pytest.mark.musa),
    pytest.param("musa", lambda mp: install_musa(mp, mccl=False), {"parallel.tp": 4, "device.count": 4},
                 "needs MCCL", marks=pytest.mark.musa),
])
def test_recipe_refusals_name_the_field(variant, install, changes, reason, monkeypatch):
    (install or VARIANTS[DEFAULT_VARIANT[variant]][1])(monkeypatch)
    det = platform_manager.detect(variant, PLUGINS[variant]())
    platform = platform_manager.Platform(det.info, PLUGINS[variant]())
    base = load_recipe("cpu_tiny").replace_paths({"platform": variant})
    assert platform.check_recipe(base) == []
    reasons = platform.check_recipe(base.replace_paths(changes))
    assert any(reason in r for r in reasons), reasons


@pytest.mark.parametrize("variant", variant_params())
def test_build_vendor_gives_a_configured_platform(variant, monkeypatch):
    vendor = build_vendor(variant, monkeypatch)
    assert vendor.platform.info.name == VARIANTS[variant][0]
    assert "set_device" in vendor.doubles.device.calls
