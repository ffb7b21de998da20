"""Fixtures of the vendor contract suite: doubles installed, a platform built on them.

The ``vendor`` fixture runs a test once per device variant below. For each it
installs the recording doubles (``tests/doubles``) and the fake device state
through ``monkeypatch``, runs the platform's real detection through
``omni.platform_manager.detect``, builds the ``Platform`` (the vendor plugin
plus the reference, as ``omni-run`` does) and configures local rank 0.
Tensors stay on the CPU: only the vendor ops are doubled, and they compute
with the reference.

Markers ``rocm``, ``npu``, ``xpu``, ``musa`` are registered here; every
variant carries its platform's marker, so a vendor CI job selects its own
cases with ``-m npu``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
for extra in (TESTS, TESTS / "conformance"):  # the doubles package; the conformance grid and oracles
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from doubles.aiter import install_rocm  # noqa: E402
from doubles.ipex import install_xpu  # noqa: E402
from doubles.recording import Call  # noqa: E402
from doubles.torch_musa import install_musa  # noqa: E402
from doubles.torch_npu import install_npu  # noqa: E402
from omni import platform_manager  # noqa: E402
from omni.platforms.musa.plugin import MusaPlatform  # noqa: E402
from omni.platforms.npu.plugin import NpuPlatform  # noqa: E402
from omni.platforms.rocm.plugin import RocmPlatform  # noqa: E402
from omni.platforms.xpu.plugin import XpuPlatform  # noqa: E402

VENDOR_PLATFORMS = ("rocm", "npu", "xpu", "musa")
PLUGINS = {"rocm": RocmPlatform, "npu": NpuPlatform, "xpu": XpuPlatform, "musa": MusaPlatform}

# variant id -> (platform, installer); one per device class whose kernels differ
VARIANTS = {
    "rocm-mi300x": ("rocm", lambda mp: install_rocm(mp, arch="gfx942")),
    "rocm-mi355x": ("rocm", lambda mp: install_rocm(mp, arch="gfx950")),
    "npu-a2": ("npu", lambda mp: install_npu(mp, soc="Ascend910B2")),
    "xpu-b70": ("xpu", lambda mp: install_xpu(mp)),
    "musa-s5000": ("musa", lambda mp: install_musa(mp, capability=(3, 1))),
}


def pytest_configure(config):
    for name in VENDOR_PLATFORMS:
        config.addinivalue_line("markers", f"{name}: {name} platform cases (contract-tested on doubles here; "
                                           f"the {name} CI job selects them with -m {name})")


@dataclass
class Vendor:
    """One double-backed platform, ready to resolve kernels."""

    variant: str
    name: str
    doubles: object
    platform: platform_manager.Platform

    def recorders(self) -> list:
        found = []
        for part in vars(self.doubles).values():
            rec = getattr(part, "recorder", None)
            found += [rec] if rec is not None else []
        return found

    def calls(self) -> list[Call]:
        return [c for rec in self.recorders() for c in rec.calls]


def build_vendor(variant: str, monkeypatch) -> Vendor:
    name, install = VARIANTS[variant]
    doubles = install(monkeypatch)
    plugin = PLUGINS[name]()
    det = platform_manager.detect(name, plugin)
    assert det.info is not None, det.reasons
    platform = platform_manager.Platform(det.info, plugin)
    platform.device_services(0)  # omni_platform_configure: binds local rank 0, as a worker does
    return Vendor(variant, name, doubles, platform)


def variant_params(platforms=VENDOR_PLATFORMS):
    return [pytest.param(v, id=v, marks=getattr(pytest.mark, p)) for v, (p, _) in VARIANTS.items() if p in platforms]


@pytest.fixture(params=variant_params())
def vendor(request, monkeypatch) -> Vendor:
    return build_vendor(request.param, monkeypatch)


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """The grid's tensors are tiny: one intra-op thread beats two fighting a busy box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
