"""bench/README.md lists every benchmark script, so a new one cannot land unlisted (or a removed one stay listed)."""
from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_bench_script_is_listed_once_and_every_listed_one_exists():
    listed = re.findall(r"^\| `([\w.]+\.py)` \|", (BENCH / "README.md").read_text(), flags=re.M)
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    assert sorted(set(listed)) == scripts, (
        f"unlisted: {sorted(set(scripts) - set(listed))}; listed but absent: {sorted(set(listed) - set(scripts))}")
    assert len(listed) == len(set(listed)), "a script is listed twice"
