"""A multi-rank replica's driver knows every rank's CUDA memory (/metrics' ``omni_device_memory_*{rank=...}``).

The ranks agree on each admit's and release's outcome in one host-side all-gather, which also carries each
rank's ``memory_stats()`` (``omni.parallel.driver``). Here a cfg2 replica's two ranks share the one GPU over
gloo, each with its own caching allocator; the follower holds a 256 MiB ballast, so its figures must be its own.
"""
from __future__ import annotations

import pytest
import torch

from omni.parallel.launch import launch
from omni.parallel.mesh import Degrees

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

BALLAST_MIB = 256


def test_the_driver_reports_each_ranks_own_device_memory():
    driver, follower = launch("parallel_capture_workers:driver_memory_run", Degrees(cfg=2), platform="cuda",
                              args=(BALLAST_MIB,), timeout_s=300, devices=1, backend="gloo")
    mine, theirs = driver["by_rank"]
    assert set(mine) == set(theirs) == {"allocated_bytes", "reserved_bytes", "peak_bytes"}, driver
    assert theirs["allocated_bytes"] - mine["allocated_bytes"] >= follower["ballast_bytes"] // 2, driver
    # the follower's figures as of the request's release, against its own reading after the replica closed
    assert theirs["allocated_bytes"] == pytest.approx(follower["own"]["allocated_bytes"], abs=16 << 20)
    assert theirs["peak_bytes"] >= theirs["allocated_bytes"] >= follower["ballast_bytes"]
