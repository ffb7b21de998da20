"""Fixtures of the vendor contract suite (variants and the builder live in vendor_cases.py).

The ``vendor`` fixture runs a test once per device variant with its doubles
installed and its platform built. Markers ``rocm``, ``npu``, ``xpu``, ``musa``
are registered here; every variant carries its platform's marker, so a
vendor CI job selects its own cases with ``-m npu``.
"""
from __future__ import annotations

import pytest

from vendor_cases import VENDOR_PLATFORMS, Vendor, build_vendor, variant_params


def pytest_configure(config):
    for name in VENDOR_PLATFORMS:
        config.addinivalue_line("markers", f"{name}: {name} platform cases (contract-tested on doubles on the CPU; "
                                           f"the {name} CI job selects them with -m {name})")


@pytest.fixture(params=variant_params())
def vendor(request, monkeypatch) -> Vendor:
    return build_vendor(request.param, monkeypatch)


@pytest.fixture(autouse=True)
def _one_cpu_thread(one_cpu_thread):  # tests/conftest.py
    yield
