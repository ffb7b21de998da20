"""``DeviceServices.expandable_segments`` on a CUDA device (``device.expandable_segments``).

The setting is process-wide, so each case runs in its own Python process: the segments reserved after the
call are expandable (``torch.cuda.memory_snapshot``'s ``is_expandable``), those of a process without it are
not, and a CUDA graph captures and replays under expandable segments with the eager result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

PROBE = r"""
import json, sys, torch
from omni.device import DeviceServices

services = DeviceServices("cuda", 0)
said = services.expandable_segments() if sys.argv[1] == "on" else "off"
x = torch.randn(4096, 4096, device="cuda")  # 64 MiB: its own segment
w = torch.randn(4096, 4096, device="cuda")
eager = x @ w
graph = torch.cuda.CUDAGraph()
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    x @ w  # warm-up outside the capture, as torch asks
torch.cuda.current_stream().wait_stream(stream)
with torch.cuda.graph(graph):
    captured = x @ w
graph.replay()
torch.cuda.synchronize()
segments = [s["is_expandable"] for s in torch.cuda.memory_snapshot()]
print(json.dumps({"said": said, "expandable": segments, "same": bool(torch.equal(eager, captured))}))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_segments_reserved_after_the_call_are_expandable_and_a_graph_replays_under_them():
    on = _probe("on")
    assert on["said"] == "set"
    assert on["expandable"] and all(on["expandable"]), on
    assert on["same"]


def test_without_the_call_the_segments_are_not_expandable():
    off = _probe("off")
    assert off["expandable"] and not any(off["expandable"]), off
    assert off["same"]


def test_metrics_report_the_devices_memory():
    """/metrics' device gauges on a CUDA device: allocated, reserved and peak bytes, each at least the tensor
    held (``omni.serving.metrics.memory_families`` over ``DeviceServices.memory_stats``, as a scrape reads them)."""
    from omni.device import DeviceServices
    from omni.serving.metrics import memory_families

    held = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    sources = [([], {"memory": [DeviceServices("cuda", 0).memory_stats()]})]
    gauges = {g.name: g.samples[0].value for g in memory_families(sources, [])}
    assert set(gauges) == {"omni_device_memory_allocated_bytes", "omni_device_memory_reserved_bytes",
                           "omni_device_memory_peak_bytes"}
    assert all(v >= held.numel() for v in gauges.values()), gauges
    assert gauges["omni_device_memory_reserved_bytes"] >= gauges["omni_device_memory_allocated_bytes"]
