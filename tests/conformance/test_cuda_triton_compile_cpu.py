"""The cuda platform's compile scope (``platforms/cuda/triton_compile.py``) without a GPU: how many threads
compile, when ``launch`` compiles instead of running, and where Triton keeps its binaries. The compiles in a
build: tests/gpu/test_gpu_moe_routing.py and tests/gpu/test_gpu_pdl.py."""
from __future__ import annotations

import os

import pytest

from omni.platforms.cuda import triton_compile as tc


def test_workers_default_to_the_cpus_this_process_may_use_capped():
    got = tc.workers({})
    assert 1 <= got <= tc.MAX_WORKERS
    assert tc.workers({"OMNI_COMPILE_WORKERS": "3"}) == 3
    assert tc.workers({"OMNI_COMPILE_WORKERS": " 1 "}) == 1  # one compile at a time, as before the pool


def test_ranks_on_one_host_split_its_cpus():
    cpus = len(os.sched_getaffinity(0))
    for ranks in (1, 2, 4, cpus, 4 * cpus):
        assert tc.workers({"LOCAL_WORLD_SIZE": str(ranks)}) == max(1, min(tc.MAX_WORKERS, cpus // ranks))
    for unreadable in ("", "0", "two"):  # a single process
        assert tc.workers({"LOCAL_WORLD_SIZE": unreadable}) == tc.workers({})
    assert tc.workers({"LOCAL_WORLD_SIZE": "8", "OMNI_COMPILE_WORKERS": "6"}) == 6  # the setting wins


@pytest.mark.parametrize("bad", ["0", "-2", "four", "1.5"])
def test_a_bad_worker_count_is_refused_naming_the_variable(bad):
    with pytest.raises(ValueError, match="OMNI_COMPILE_WORKERS.*positive integer"):
        tc.workers({"OMNI_COMPILE_WORKERS": bad})


def test_the_scope_turns_compile_only_on_nests_and_restores(monkeypatch):
    monkeypatch.setenv("OMNI_COMPILE_WORKERS", "1")  # no pool: the scope's flag alone
    assert not tc.compile_only()
    with tc.compiling():
        assert tc.compile_only()
        with tc.compiling():  # launch's PDL classes inside the build's scope join it
            assert tc.compile_only()
        assert tc.compile_only()
    assert not tc.compile_only()


def test_an_error_inside_the_scope_leaves_it(monkeypatch):
    monkeypatch.setenv("OMNI_COMPILE_WORKERS", "1")
    with pytest.raises(RuntimeError, match="boom"):
        with tc.compiling():
            raise RuntimeError("boom")
    assert not tc.compile_only()


def test_a_forked_child_makes_its_own_pool(monkeypatch):
    """A ThreadPoolExecutor copied by fork has no threads to run its work: the child must not reuse it."""
    tc._POOLS[2] = "the parent's pool"
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if the pools were dropped at fork
        os._exit(0 if tc._POOLS == {} else 1)
    _, status = os.waitpid(pid, 0)
    tc._POOLS.pop(2)
    assert os.waitstatus_to_exitcode(status) == 0


def test_triton_binaries_are_kept_in_our_kernel_cache_when_only_it_is_named(tmp_path):
    env = {"OMNI_KERNEL_CACHE": str(tmp_path)}
    assert tc.keep_binaries_with_ours(env) == str(tmp_path / "triton")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    explicit = {"OMNI_KERNEL_CACHE": str(tmp_path), "TRITON_CACHE_DIR": "/elsewhere"}
    assert tc.keep_binaries_with_ours(explicit) is None and explicit["TRITON_CACHE_DIR"] == "/elsewhere"
    for unset in ({}, {"OMNI_KERNEL_CACHE": " "}):  # Triton keeps its own default
        assert tc.keep_binaries_with_ours(unset) is None and "TRITON_CACHE_DIR" not in unset


def test_the_cuda_platform_sets_triton_s_cache_when_a_worker_is_configured(tmp_path, monkeypatch):
    """Through pluggy, as the host calls it (the override must be a hookimpl of its own); the device double
    records set_device, the one CUDA call the hook makes."""
    import pluggy

    from omni import hookspecs
    from omni.platforms.cuda.plugin import CudaPlatform

    class Device:
        def __init__(self):
            self.calls = []

        def set_device(self, index):
            self.calls.append(index)

    monkeypatch.setenv("OMNI_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # blank reads as unset; monkeypatch restores what was there
    plugin, device = CudaPlatform(), Device()
    monkeypatch.setattr(plugin, "device_module", lambda: device)
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    assert pm.hook.omni_platform_configure(info=None, local_rank=1) is True  # firstresult
    assert device.calls == [1]
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


def test_the_cuda_platform_answers_the_compile_scope_hook_where_triton_is(monkeypatch):
    """``omni_compile_scope`` through pluggy: the compile scope where Triton is installed (inside it ``launch``
    compiles), None where it is not (no compile pass runs: nothing would compile)."""
    import pluggy

    from omni import hookspecs
    from omni.platforms.cuda import plugin as cuda_plugin

    monkeypatch.setenv("OMNI_COMPILE_WORKERS", "1")  # no pool: the scope's flag alone
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(cuda_plugin.CudaPlatform())
    for found in (True, False):
        monkeypatch.setattr(cuda_plugin, "triton_found", lambda found=found: found)
        scope = pm.hook.omni_compile_scope(info=None)
        if not found:
            assert scope is None
            continue
        with scope:
            assert tc.compile_only()
        assert not tc.compile_only()


COMPILE_ONE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from omni.platforms.cuda.triton_compile import keep_binaries_with_ours

keep_binaries_with_ours()  # after Triton's import, as in a worker: Triton reads the folder at each compile

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

triton.compile(ASTSource(add_one, signature={"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                         constexprs={"BLOCK": 128}), target=GPUTarget("cuda", 90, 32))
"""


def test_a_restart_finds_the_binaries_in_the_kept_folder(tmp_path):
    """Triton compiles for sm_90 without a GPU (ptxas is in its wheel): the first process writes the binary under
    ``$OMNI_KERNEL_CACHE/triton``, a second one finds it there and writes nothing."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    kept, script = tmp_path / "kernels", tmp_path / "compile_one.py"  # Triton reads a kernel's source from its file
    script.write_text(COMPILE_ONE)
    env = {**os.environ, "OMNI_KERNEL_CACHE": str(kept)}
    env.pop("TRITON_CACHE_DIR", None)
    files = []
    for _ in range(2):
        subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
        files.append(sorted((p.relative_to(kept), p.stat().st_mtime_ns) for p in kept.rglob("*") if p.is_file()))
    assert [p for p, _ in files[0] if p.suffix == ".cubin"] and all(p.parts[0] == "triton" for p, _ in files[0])
    assert files[1] == files[0]  # nothing compiled or rewritten the second time
