"""Triton's host launchers for the cuda platform's kernels, on this machine's CPUs, no GPU needed: how many distinct
launchers the binaries of an image step, a decode step and the image heads need, and what building them costs one
after another (one thread: what their first launches paid, in turn, before ``triton_compile.compiling()`` built
them) against on more threads of the compile pool (``triton_compile.build_launchers``, each thread count asked for).

Why: Triton builds a kernel's launcher (C source for its signature, compiled by the host's C compiler) when the
kernel first launches, not when it compiles. After a compile pass had compiled every binary, the first 3-word
prompt still spent 0.19 s more in its prefill than a 40-word one, with no binary compiled (H100, BENCHMARKS.md
"Thirty-sixth session").

How: the calls of ``bench/kernel_resources.py`` compiled for sm_90 under its stub driver; then, for each run, an
empty Triton cache and Triton's real launcher builder (``CudaLauncher``), linked against a stand-in libcuda that
only defines the calls a launcher links to (``kernel_resources.stand_in_libcuda``). The C compile is the host's
own work, so it is what a GPU host's CPUs would do; their speed differs.

    PYTHONPATH=/tmp/tri python bench/launchers_cpu.py --workers 1,2 --rounds 2 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kernel_resources as kr  # noqa: E402


def compiled_kernels() -> list:
    """Every binary the platform's Triton kernels hold for device 0 (``CompiledKernel``s)."""
    from triton.runtime.jit import JITFunction

    found, seen = [], set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("omni.platforms.cuda"):
            continue
        for fn in vars(module).values():
            if isinstance(fn, JITFunction) and id(fn) not in seen and 0 in fn.device_caches:
                seen.add(id(fn))
                found.extend(fn.device_caches[0][0].values())
    return found


def timed_in_empty_cache(fn) -> float:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="omni-launchers-")  # Triton reads it at each build
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2", help="compile-pool threads to try, in turn each round (1: one at a time)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="omni-res-")
    kr.stand_in_libcuda(Path(tempfile.mkdtemp(prefix="omni-libcuda-")))
    kr.stub_driver(launchers=False)  # the binaries first, without their launchers
    from omni.memory_estimate import released_config
    from omni.platforms.cuda.triton_compile import _launcher_key, build_launchers, compiling

    args = argparse.Namespace(no_fused_shared=False, tokens=kr.TOKENS)
    for _label, call in kr.every_call(released_config(), args, None):
        with compiling():
            call()
    kernels = compiled_kernels()
    distinct = len({_launcher_key(k) for k in kernels})
    print(f"{len(kernels)} binaries, {distinct} distinct launchers", flush=True)
    kr.stub_driver(launchers=True)
    rows = []
    for r in range(a.rounds):
        for n in (int(w) for w in a.workers.split(",")):
            with ThreadPoolExecutor(n) as pool:
                rows.append({"round": r, "workers": n,
                             "seconds": timed_in_empty_cache(lambda: build_launchers(kernels, pool))})
            print(f"round {r}: {n} threads {rows[-1]['seconds']:.2f} s", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"cpus": len(os.sched_getaffinity(0)), "binaries": len(kernels),
                                      "launchers": distinct, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
