"""``bench/probe_floor_attention.py``'s dry run on the CPU: the probe the device runs to tell why the floor's
attention reads slower than the captured step's, end to end on the reference platform (small widths)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).resolve().parents[1] / "bench" / "probe_floor_attention.py"


def test_probe_times_the_floor_call_and_the_engine_call_over_the_same_tables(tmp_path):
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, str(PROBE), "--size", "64x64", "--prefix", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    # the floor times the engine's varlen tables: two rows, each a 1-query run and a 16-query image run
    assert got["floor_tables"] == got["engine_tables"]
    assert got["engine_tables"]["cu_q"] == [0, 1, 17, 18, 34] and got["engine_tables"]["max_k"] == 8 + 1 + 16
    assert set(got["calls"]) == {"floor_call", "engine_inputs", "engine_meta_randn", "floor_meta_engine_inputs"}
    assert all(c["eager_back_to_back_s"] > 0 for c in got["calls"].values())
