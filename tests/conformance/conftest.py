"""Platform selection for the conformance suite.

Every test that takes ``platform_name`` runs once per platform under test:
``cpu`` always, ``cuda`` marked ``gpu`` and skipped with a reason where no
CUDA device is present or torch is a ROCm build. ``--platforms cpu,cuda`` narrows or widens the list
(a third-party platform installed under ``omni.platforms`` can be named too).
"""
from __future__ import annotations

import pytest
import torch

from conformance_cases import NOT_CUDA_ON_ROCM, RESOLVED, ROCM_BUILD

DEFAULT_PLATFORMS = "cpu,cuda"


def pytest_addoption(parser):
    parser.addoption("--platforms", default=DEFAULT_PLATFORMS,
                     help="comma-separated platforms the conformance suite runs against (default: cpu,cuda)")


def _param(name: str):
    if name == "cpu":
        return pytest.param(name, id=name)
    marks = [pytest.mark.gpu] if name == "cuda" else []
    if name == "cuda" and ROCM_BUILD:
        marks.append(pytest.mark.skip(reason=NOT_CUDA_ON_ROCM))
    elif name == "cuda" and not torch.cuda.is_available():
        marks.append(pytest.mark.skip(reason="cuda: no CUDA device here (torch.cuda.is_available() is False)"))
    return pytest.param(name, id=name, marks=marks)


def pytest_generate_tests(metafunc):
    if "platform_name" in metafunc.fixturenames:
        names = [n.strip() for n in metafunc.config.getoption("--platforms").split(",") if n.strip()]
        metafunc.parametrize("platform_name", [_param(n) for n in names])


def pytest_terminal_summary(terminalreporter):
    if not RESOLVED:
        return
    terminalreporter.section("conformance: kernels that answered")
    for key in sorted(RESOLVED):
        terminalreporter.write_line(f"{' '.join(map(str, key))} -> {', '.join(sorted(RESOLVED[key]))}")


@pytest.fixture(autouse=True)
def _one_cpu_thread(one_cpu_thread):  # tests/conftest.py
    yield
