"""Wall time of the cuda platform's compile scope on this machine's CPUs, no GPU needed: the kernels of a compile
pass (the router with its PDL classes, the expert sort, GroupNorm, Winograd: 10 binaries) compiled for sm_90 by
Triton's real compiler under a stub driver, from an empty Triton cache, with each compile-thread count asked for.

It runs the child of ``tests/conformance/test_cuda_sm90_compile_cpu.py`` (the compile-pass case) in a fresh
process per run, timing the scope alone. What it shows: the scope's compiles overlap on the pool
(``OMNI_COMPILE_WORKERS``); the GPU host's own figure is ``bench/profile_first_use.py --warm-up --compile-first``.

    PYTHONPATH=/tmp/tri python bench/compile_pass_cpu.py --workers 1,2 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TEST = Path(__file__).resolve().parents[1] / "tests" / "conformance" / "test_cuda_sm90_compile_cpu.py"


def child() -> str:
    """The conformance test's compile-pass child (it reports the scope's seconds as ``scope_s``)."""
    ns: dict = {"__file__": str(TEST)}
    exec(compile(TEST.read_text(), str(TEST), "exec"), ns)  # its module body only defines strings and tests
    return ns["PASS_CHILD"]


def run(code: str, workers: str) -> dict:
    env = {**os.environ, "OMNI_COMPILE_WORKERS": workers, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="omni-tri-")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"the child failed (Triton on the path?):\n{done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return {"workers": int(workers), "scope_s": round(got["scope_s"], 3), "binaries": sum(got["added"].values())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2", help="compile threads to try, in turn each round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    code, rows = child(), []
    for r in range(a.rounds):
        for w in a.workers.split(","):
            rows.append({"round": r} | run(code, w))
            print(rows[-1], flush=True)
    if a.json:
        a.json.write_text(json.dumps({"cpus": len(os.sched_getaffinity(0)), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
