"""Triton compiles in parallel: the build's (the MoE sort's and the few-row GEMM's row classes) and a kernel
signature's PDL classes at its first launch.

Why: each binary takes about half a second to compile (Triton's passes, LLVM, ptxas), and the build compiled
its binaries one after another: ready in 16.6 s from an empty Triton cache on the H200, of which about 8 s were
those compiles (BENCHMARKS.md, "Twenty-ninth session"). Triton's compiler releases the GIL in its passes and
runs ptxas as a process, so threads overlap them: 13.8 -> 10.9 s ready on the H200's 16 CPUs, same machine
(BENCHMARKS.md, "Thirty-first session").

``compiling()`` is the scope: inside it ``pdl_triton.launch`` hands each kernel to Triton's ``warmup`` instead
of running it, and Triton's ``AsyncCompileMode`` submits the compile to a thread pool; leaving the scope waits
for every compile (raising the first error), puts the binaries in the kernels' caches and builds their host
launchers on the same pool (``build_launchers``). Calls made inside it
run their torch ops but no Triton kernel (``launch`` and ``run_or_compile`` only compile), so their outputs are
undefined: only the compile-time paths enter it (``compile_routes``, ``compile_rows``, ``launch``'s PDL classes,
and a server warm-up's compile pass through ``omni_compile_scope``, in which the router and the expert sort
answer with torch's outputs). ``OMNI_COMPILE_WORKERS`` sets the
pool's threads (1: one compile at a time, as before); the default is the CPUs this process may use, shared
among the ranks on its host (``LOCAL_WORLD_SIZE``), at most 16. A Triton without ``AsyncCompileMode`` (3.6 has
it) compiles in the caller's thread, and Triton builds each launcher at its kernel's first launch.

``keep_binaries_with_ours`` points Triton's cache into ``OMNI_KERNEL_CACHE`` where that is set and
``TRITON_CACHE_DIR`` is not, so that one kept folder holds every compiled kernel (our CUTLASS objects and
Triton's binaries): a restart with it finds the binaries compiled before.

This module imports Triton only inside ``compiling()``, so the CPU tests read it.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

log = logging.getLogger("omni.cuda")
MAX_WORKERS = 16  # a cap: the one host measured had 16 CPUs (BENCHMARKS.md); more threads were not measured
_COMPILE_ONLY: ContextVar[bool] = ContextVar("omni_compile_only", default=False)
_POOLS: dict[int, ThreadPoolExecutor] = {}  # by thread count, made at first use
if hasattr(os, "register_at_fork"):  # a forked child has none of the pools' threads: it makes its own
    os.register_at_fork(after_in_child=_POOLS.clear)


def workers(environ=os.environ) -> int:
    """The pool's threads: ``OMNI_COMPILE_WORKERS`` (a positive integer), else this process's share of its CPUs
    (split among the ``LOCAL_WORLD_SIZE`` ranks on this host, which torchrun and ``omni.parallel.launch`` set),
    at most ``MAX_WORKERS``. Every rank builds, and so compiles, at the same time: eight ranks of 16 threads
    each on a host of 64 CPUs would run twice as many compile threads as it has CPUs."""
    raw = environ.get("OMNI_COMPILE_WORKERS", "").strip()
    if not raw:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(MAX_WORKERS, cpus // _ranks_on_host(environ)))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"OMNI_COMPILE_WORKERS must be a positive integer (threads compiling Triton kernels), "
                         f"got {raw!r}")
    return int(raw)


def keep_binaries_with_ours(environ=os.environ) -> str | None:
    """Set ``TRITON_CACHE_DIR`` to ``$OMNI_KERNEL_CACHE/triton`` when only the latter is set (Triton reads it at
    each compile; ranks spawned later inherit it); returns the folder set, else None (an explicit
    ``TRITON_CACHE_DIR`` wins; without ``OMNI_KERNEL_CACHE`` Triton keeps its own default, ``~/.triton``)."""
    ours = environ.get("OMNI_KERNEL_CACHE", "").strip()
    if not ours or environ.get("TRITON_CACHE_DIR", "").strip():
        return None
    environ["TRITON_CACHE_DIR"] = os.path.join(ours, "triton")
    return environ["TRITON_CACHE_DIR"]


def _ranks_on_host(environ) -> int:
    """``LOCAL_WORLD_SIZE`` where it is a positive integer, else 1 (a single process)."""
    raw = environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def compile_only() -> bool:
    """Whether ``launch`` compiles instead of running (inside ``compiling()``)."""
    return _COMPILE_ONLY.get()


def run_or_compile(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or inside ``compiling()`` its compile only (Triton's ``warmup``, handed to
    the pool): the launch of the kernels without PDL classes (GroupNorm, Winograd), so that a compile pass
    compiles them with the others instead of one at a time as they run."""
    if compile_only():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


@contextmanager
def compiling():
    """The scope in which ``launch`` compiles (see the module docstring); nested scopes join the outer one."""
    if _COMPILE_ONLY.get():
        yield
        return
    token = _COMPILE_ONLY.set(True)
    try:
        with _async_mode():
            yield
    finally:
        _COMPILE_ONLY.reset(token)


@contextmanager
def _async_mode():
    """Triton's ``AsyncCompileMode`` over the pool (its exit waits for every compile, then the launchers are
    built), or nothing where this Triton lacks it. One thread still goes through the pool: the compiles run one at
    a time, and the launchers are built here too."""
    n = workers()
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        AsyncCompileMode = None
    if AsyncCompileMode is None:
        yield
        return
    if n not in _POOLS:
        _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="omni-triton-compile")
    with AsyncCompileMode(_POOLS[n]) as mode:
        yield
    build_launchers([f.kernel for f in mode.future_kernels.values() if f.kernel is not None], _POOLS[n])


def build_launchers(kernels: list, pool: ThreadPoolExecutor) -> int:
    """Build the host launcher of each of ``kernels`` (Triton ``CompiledKernel``s) on ``pool``, one per distinct
    signature; returns how many were built.

    Why: Triton builds a kernel's launcher (C source for its signature, compiled with the host's C compiler into
    its cache) at the kernel's first launch, not when it compiles the kernel, so a binary compiled in the scope
    still cost a C compile, one after another, when a step first ran it. An image step, a decode step and the
    heads need 19 launchers for their 63 binaries: 2.6 s one at a time on the 2-core box (bench/launchers_cpu.py).
    On an H100 host (8 layers, one run each) the Instruct warm-up took 7.3 s instead of 12.8 s with them built
    here, and h200_fp8's first 3-word prefill 0.023 s instead of 0.344 s (BENCHMARKS.md, thirty-sixth session).
    Built here, the first launch finds its launcher in Triton's cache. Only the
    launcher is built: loading the binary into the device's context stays with the first launch, on its device.
    A failure is logged: the first launch then builds it again and raises what is wrong."""
    if not kernels:  # nothing compiled (everything was in the cache): no driver is asked for
        return 0
    from triton.runtime import driver

    make = getattr(driver.active, "launcher_cls", None)
    if make is None:
        return 0
    distinct = {_launcher_key(k): k for k in kernels}

    def one(kernel):
        try:
            make(kernel.src, kernel.metadata)
        except Exception as err:  # noqa: BLE001 - the first launch builds it again and raises what is wrong
            log.warning("building the launcher of %s ahead of its launch failed: %s: %s",
                        getattr(kernel, "name", "?"), type(err).__name__, err)

    list(pool.map(one, distinct.values()))
    return len(distinct)


def _launcher_key(kernel) -> str:
    """What a launcher's source depends on (Triton 3.6's ``make_launcher``): the arguments' types and any tensor
    descriptors, not the constexpr values; kernels of one signature share a launcher in Triton's cache."""
    signature = getattr(kernel.src, "signature", {})
    return repr((list(signature.items()), getattr(kernel.metadata, "tensordesc_meta", None)))
