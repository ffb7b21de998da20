"""``bench/bench_fast.py``'s dry run on the CPU (``--platform cpu --config small``): the script the device runs for
the engine and floor figures, end to end on the reference platform, so that a change to it is not first run on a
lent GPU. Every part runs but the graph-captured step (the reference has no graphs, and says so in ``errors``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_fast.py"
STEP_KERNELS = {"qkv", "o_proj", "shared_gate_up", "shared_down", "router", "experts_gate_up", "experts_down",
                "attention"}


def test_bench_fast_runs_the_engine_and_the_floor_on_the_reference(tmp_path):
    out = tmp_path / "fast.json"
    done = subprocess.run([sys.executable, str(BENCH), "--platform", "cpu", "--config", "small", "--layers", "1",
                           "--steps", "2", "--timed", "1", "--no-naive", "--no-vae", "--no-profile", "--size", "64x64",
                           "--prefix", "8", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got["errors"]) == {"graph_fp8", "graph_bf16"}, got["errors"]
    assert all("runs eagerly" in why for why in got["errors"].values())
    for prec in ("fp8", "bf16"):
        kernels = got["floor"][prec]["kernels_s"]
        assert set(kernels) == STEP_KERNELS and all(t > 0 for t in kernels.values())
        assert got["engine_" + prec]["step_eager_s"] > 0
    assert got["floor"]["grouped_kernel"].startswith("reference-grouped[fp8_row]")
    assert got["engine_fp8"]["quant"] == "fp8_row" and got["quality_random_layers"]["gate"] in ("pass", "fail")
    assert isinstance(got["commit"], str) and got["commit"]  # the checkout's, OMNI_BENCH_COMMIT's or "unknown"
