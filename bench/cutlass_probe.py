"""Building the diagnostic CUTLASS probes of bench/csrc (bench_cutlass_dense.py, bench_cutlass_contiguous.py).

Each probe is one .cu file compiled by nvcc (no GPU needed) into
``$OMNI_KERNEL_CACHE`` (default: omni-kernels under the system temp folder),
keyed by its source, the nvcc version, the target and the CUTLASS headers, and
reused; a file lock serializes concurrent builds. The configurations an object
exports are read from its symbols, as ``cutlass_grouped.exported_configs`` does.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omni.platforms.cuda.cutlass_grouped import ARCH, compile_command, find_cutlass_include, find_nvcc


def cache_dir() -> Path:
    return Path(os.environ.get("OMNI_KERNEL_CACHE") or Path(tempfile.gettempdir()) / "omni-kernels")


def probe_library(source: Path, given: Path | None) -> Path:
    """``given`` (a built object, ``--lib``), else ``source``'s object from the cache or compiled into it."""
    if given is not None:
        return given
    nvcc, include = find_nvcc(), find_cutlass_include()
    if not nvcc or not include:
        raise SystemExit(f"need nvcc ({nvcc}) and CUTLASS's headers ({include}; set OMNI_CUTLASS_INCLUDE)")
    return build_probe(source, nvcc, include)


def build_probe(source: Path, nvcc: str, include: str) -> Path:
    """``source``'s shared object: from the cache, or compiled into it."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    version_h = Path(include) / "cutlass" / "version.h"
    h = hashlib.sha256()
    for part in (source.read_text(), version, ARCH, version_h.read_text() if version_h.is_file() else include):
        h.update(part.encode())
    where = cache_dir()
    where.mkdir(parents=True, exist_ok=True)
    out = where / f"{source.stem}_{h.hexdigest()[:16]}.so"
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            compile_into(source, nvcc, include, out)
    return out


def compile_into(source: Path, nvcc: str, include: str, out: Path) -> None:
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    print(f"compiling {source.name} with {nvcc} (1-2 minutes) -> {out}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    done = subprocess.run(compile_command(nvcc, include, source, tmp), capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"nvcc failed ({done.returncode}):\n{done.stderr or done.stdout}")
    tmp.replace(out)  # atomic: a reader never sees half an object
    print(f"built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)


def probe_configs(library: Path, prefix: str) -> list[str]:
    """The configuration names ``library`` exports as ``<prefix>_<name>_run``."""
    return sorted({m.decode() for m in re.findall(rb"%s_(\w+?)_run\x00" % prefix.encode(), library.read_bytes())})
