"""bench/bench_parallel.py runs end to end (tiny widths, CPU, gloo) so the GPU run does not fail on plumbing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # bench smoke: python -m pytest -m slow


@pytest.mark.parametrize("layout", ["tp2", "cfg2"])
def test_bench_parallel_reports_time_comm_and_memory(tmp_path, layout):
    out = tmp_path / f"{layout}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_parallel.py"), "--platform", "cpu", "--config", "tiny",
           "--layout", layout, "--layers", "1", "--steps", "1", "--warmup", "0", "--prompt-tokens", "30",
           "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=os.environ)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["layout"] == layout and result["world"] == 2 and len(result["per_rank"]) == 2
    for r in result["per_rank"]:
        assert r["step_s"] > 0 and 0 <= r["comm_share"] < 1 and r["nocomm_step_s"] > 0 and r["peak_mem_gib"] > 0
        assert r["collective_calls_per_step"] == (2 if layout == "tp2" else 1)  # 2 all-reduces per layer / 1 gather
    assert f"layout {layout}" in run.stdout


def test_bench_parallel_capture_is_refused_on_the_reference_with_the_reason(tmp_path):
    """``--graph capture`` builds capturable kernels: the CPU reference refuses them, naming why (on CUDA the
    ranks replay their steps; tests/gpu/test_gpu_parallel_capture.py)."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench_parallel.py"), "--platform", "cpu", "--config", "tiny",
           "--layout", "cfg2", "--layers", "1", "--steps", "1", "--warmup", "0", "--graph", "capture",
           "--json", str(tmp_path / "x.json")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=os.environ)
    assert run.returncode != 0 and "not capturable" in run.stderr
