"""A cpu platform's peak memory figure (``DeviceServices.memory_stats()["peak_bytes"]``) is its own process's.

It feeds ``omni_device_memory_peak_bytes`` on /metrics, one per rank of a multi-rank replica. Linux's
``ru_maxrss`` survives fork and exec, so every rank spawned by a large launcher (a test runner, a long-lived
server) would report the launcher's peak; ``VmHWM`` starts afresh with the process image.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from omni.device import DeviceServices, peak_rss_bytes

BALLAST = 768 << 20  # bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_spawned_process_reports_its_own_peak_not_its_launchers():
    ballast = torch.ones(BALLAST // 4)  # touched: its pages are resident in this process
    parent = peak_rss_bytes()
    assert DeviceServices("cpu", 0).memory_stats() == {"peak_bytes": pytest.approx(parent, rel=0.05)}
    child = int(subprocess.run([sys.executable, "-c", "from omni.device import peak_rss_bytes; "
                                "print(peak_rss_bytes())"], capture_output=True, text=True, check=True).stdout)
    assert parent >= ballast.numel() * 4, parent
    assert child < parent - BALLAST // 2, f"the child reports {child} bytes, its launcher {parent}"

