"""``omni-run bench`` in-process on CUDA builds the engine as ``omni-run serve`` does: the server's warm-up runs
before ready, through the compile pass where ``serving.compile_first``, and the JSON splits ``time_to_ready_s``
into build and warm-up. One ``omni-run bench`` process (an empty Triton cache, ``TRITON_CACHE_DIR``) on the
embedded tiny base model in bf16 with ``graph.mode: capture``, the way h200_fp8 serves.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

SETS = ("platform=cuda", "device.kind=h200", "model.dtype=bfloat16", "graph.mode=capture",
        "serving.compile_first=true")


def bench(tmp_path, *extra) -> dict:
    out = tmp_path / "bench.json"
    sets = [a for s in SETS for a in ("--set", s)]
    cmd = [sys.executable, "-m", "omni.cli", "bench", "--recipe", "cpu_tiny", *sets, "--concurrency", "1",
           "--requests", "2", "--steps", "2", "--sizes", "256x256", "--warmup", "0", "--json", str(out), *extra]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_in_process_bench_is_ready_after_the_servers_warm_up_and_its_compile_pass(tmp_path):
    report = bench(tmp_path)
    ready = report["ready"]
    assert ready["compile_pass_s"] is not None and ready["compile_pass_s"] > 0
    assert ready["warm_up_s"] > ready["compile_pass_s"] and ready["build_s"] > 0
    assert ready["build_s"] + ready["warm_up_s"] == pytest.approx(report["time_to_ready_s"], abs=0.05)
    assert report["levels"][0]["ok"] == 2 and "NVIDIA" in report["host"]["device"]


def test_without_the_server_warm_up_the_bench_counts_the_build_alone(tmp_path):
    report = bench(tmp_path, "--no-server-warm-up")
    ready = report["ready"]
    assert ready["warm_up_s"] is None and ready["compile_pass_s"] is None
    assert ready["build_s"] == pytest.approx(report["time_to_ready_s"], abs=0.05)
    assert report["levels"][0]["ok"] == 2
