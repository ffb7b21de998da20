"""The device variants of the contract suite and how a double-backed platform is built.

For each variant, ``build_vendor`` installs the recording doubles
(``tests/doubles``) and the fake device state through ``monkeypatch``, runs
the platform's real detection through ``omni.platform_manager.detect``,
builds the ``Platform`` (the vendor plugin plus the reference, as ``omni-run``
does) and configures local rank 0. Tensors stay on the CPU: only the vendor
ops are doubled, and they compute with the reference.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

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
DEFAULT_VARIANT = {"rocm": "rocm-mi300x", "npu": "npu-a2", "xpu": "xpu-b70", "musa": "musa-s5000"}


@dataclass
class Vendor:
    """One double-backed platform, ready to resolve kernels."""

    variant: str
    name: str
    doubles: object
    platform: platform_manager.Platform

    def recorders(self) -> list:
        parts = (getattr(part, "recorder", None) for part in vars(self.doubles).values())
        return [rec for rec in parts if rec is not None]

    def calls(self) -> list[Call]:
        """Every recorded vendor call (grouped per double, in call order within each)."""
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
    """One ``pytest.param`` per variant, marked with its platform's marker."""
    return [pytest.param(v, id=v, marks=getattr(pytest.mark, p)) for v, (p, _) in VARIANTS.items() if p in platforms]
