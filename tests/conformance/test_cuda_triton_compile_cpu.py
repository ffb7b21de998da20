"""The cuda platform's compile scope (``platforms/cuda/triton_compile.py``) without a GPU: how many threads
compile, and when ``launch`` compiles instead of running. The compiles themselves: tests/gpu/test_gpu_moe_routing.py
and tests/gpu/test_gpu_pdl.py."""
from __future__ import annotations

import pytest

from omni.platforms.cuda import triton_compile as tc


def test_workers_default_to_the_cpus_this_process_may_use_capped():
    got = tc.workers({})
    assert 1 <= got <= tc.MAX_WORKERS
    assert tc.workers({"OMNI_COMPILE_WORKERS": "3"}) == 3
    assert tc.workers({"OMNI_COMPILE_WORKERS": " 1 "}) == 1  # one compile at a time, as before the pool


def test_ranks_on_one_host_split_its_cpus():
    import os

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
    import os

    tc._POOLS[2] = "the parent's pool"
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if the pools were dropped at fork
        os._exit(0 if tc._POOLS == {} else 1)
    _, status = os.waitpid(pid, 0)
    tc._POOLS.pop(2)
    assert os.waitstatus_to_exitcode(status) == 0
