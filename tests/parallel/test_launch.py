"""The launcher: results back, a failing rank ends the job with its error, no orphans, multi-host on loopback."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import describe, wait_gone
from omni.parallel.launch import RankInfo, free_port, launch
from omni.parallel.supervise import WorkerError
from omni.parallel.mesh import Degrees

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
FAST_S = 40  # well under the gloo timeout: a hang would show as a timeout here
pytestmark = pytest.mark.timeout(120)


def read_pids(d: Path, n: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(d.glob("rank*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise TimeoutError(f"workers did not start: {list(d.iterdir())}")


def test_results_come_back_in_rank_order():
    import workers

    out = launch(workers.hosts_check, Degrees(tp=2), timeout_s=FAST_S)
    assert out == ["rank=0 node=0 world=2 sum=3", "rank=1 node=0 world=2 sum=3"]


def test_failing_rank_ends_the_job_with_its_error():
    import workers

    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        launch(workers.fail_on_rank_one, Degrees(cfg=2), timeout_s=FAST_S)
    assert err.value.rank == 1 and "ValueError: boom on rank one" in str(err.value)
    assert "fail_on_rank_one" in err.value.worker_traceback  # the worker's own traceback
    assert time.monotonic() - t0 < FAST_S


def test_rank_dying_without_exception_is_reported():
    import workers

    with pytest.raises(WorkerError) as err:
        launch(workers.die_on_rank_one, Degrees(tp=2), timeout_s=FAST_S)
    assert err.value.rank == 1 and "exited with code 3" in str(err.value)


def _start_sleepers(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    cmd = [sys.executable, "-m", "omni.parallel.launch", "--cfg", "2", "workers:sleeper", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, read_pids(tmp_path, 2)


def test_ctrl_c_stops_every_worker(tmp_path):
    proc, pids = _start_sleepers(tmp_path)
    proc.send_signal(signal.SIGINT)  # the launcher only: it must stop the workers itself
    try:
        _, err = proc.communicate(timeout=FAST_S)
    except subprocess.TimeoutExpired:
        tree = describe(proc.pid)
        proc.kill()
        pytest.fail(f"the launcher did not stop within {FAST_S} s of Ctrl-C; processes then:\n{tree}")
    assert proc.returncode == 130 and "interrupted; all workers stopped" in err
    assert wait_gone(pids) == []


def test_ctrl_c_held_back_while_the_last_worker_spawns_stops_it_too(tmp_path, monkeypatch):
    """SIGINT is blocked while a worker spawns, so a Ctrl-C then is raised as the mask comes off, before
    ``p.start()`` returns to ``launch``: that worker must be among those stopped, or the interpreter's exit
    would wait on it (multiprocessing joins live children at exit)."""
    import contextlib
    import multiprocessing

    from omni.parallel import launch as launch_mod

    real, spawned = launch_mod._sigint_blocked, []

    @contextlib.contextmanager
    def interrupted_on_the_second():
        with real():
            yield
            spawned.append(True)
            if len(spawned) == 2:
                os.kill(os.getpid(), signal.SIGINT)  # pending: this thread blocks it until the mask comes off

    monkeypatch.setattr(launch_mod, "_sigint_blocked", interrupted_on_the_second)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch("workers:sleeper", Degrees(cfg=2), args=(str(tmp_path),), timeout_s=FAST_S)
    assert len(spawned) == 2 and time.monotonic() - t0 < FAST_S
    assert multiprocessing.active_children() == [], "a worker outlived the interrupted launch"


def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    proc, pids = _start_sleepers(tmp_path)
    proc.kill()  # SIGKILL: no cleanup code runs in the launcher
    proc.wait(timeout=FAST_S)
    assert wait_gone(pids) == [], "orphaned workers survived their launcher"


def _two_hosts(make_cmd) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen(make_cmd(node, port), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for node in (0, 1)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def test_two_hosts_on_loopback_with_our_launcher():
    outs = _two_hosts(lambda node, port: [
        sys.executable, "-m", "omni.parallel.launch", "--nnodes", "2", "--node-rank", str(node),
        "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "--tp", "2",
        "workers:hosts_check"])
    assert "rank=0 node=0 world=2 sum=3" in outs[0] and "rank=1 node=1 world=2 sum=3" in outs[1]


def test_two_hosts_on_loopback_under_torchrun():
    outs = _two_hosts(lambda node, port: [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
        "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
        "-m", "omni.parallel.launch", "--tp", "2", "workers:hosts_check"])
    assert "rank=0 node=0 world=2 sum=3" in outs[0] and "rank=1 node=1 world=2 sum=3" in outs[1]


def test_each_rank_compiles_on_its_share_of_the_host(monkeypatch):
    """The launcher tells each rank how many ranks share its host (``LOCAL_WORLD_SIZE``, as torchrun does), so
    that the ranks' kernel compile pools, which run at the same time, split the CPUs instead of each taking all."""
    import workers
    from omni.platforms.cuda.triton_compile import MAX_WORKERS

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "7")  # a stale value from an outer job: the launcher's count wins
    cpus = len(os.sched_getaffinity(0))
    out = launch(workers.host_share, Degrees(tp=2), timeout_s=FAST_S)
    assert out == [("2", max(1, min(MAX_WORKERS, cpus // 2)))] * 2


def test_rank_info_from_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"}
    assert RankInfo.from_env(env) == RankInfo(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1,
                                              master_addr="10.0.0.1", master_port=29501, init_method="env://")
    assert RankInfo.from_env({}) is None


def test_world_size_mismatch_is_refused_before_spawning():
    with pytest.raises(ValueError, match="needs 4 ranks; 1 node.s. x 3"):
        launch("workers:hosts_check", Degrees(cfg=2, tp=2), nproc_per_node=3)
    with pytest.raises(ValueError, match="explicit master_port"):
        launch("workers:hosts_check", Degrees(tp=2), nnodes=2, nproc_per_node=1)


def test_ranks_can_share_one_device_over_a_chosen_backend():
    """``devices=1``: both ranks bind local device 0 (tests on a one-GPU machine); without it each binds its
    local rank. ``backend`` overrides the platform's."""
    shared = launch("workers:binding_report", Degrees(tp=2), devices=1, backend="gloo", timeout_s=60)
    assert shared == [(0, 0, "gloo"), (1, 0, "gloo")]
    assert [r[1] for r in launch("workers:binding_report", Degrees(tp=2), timeout_s=60)] == [0, 1]


PROBE_PLATFORM = """
from omni.hookspecs import hookimpl
from omni.specs import PlatformInfo


class SharingProbe:
    @hookimpl
    def omni_platform_detect(self, reject):
        return PlatformInfo(name="sharing_probe", device_type="cpu", dist_backend="gloo", device_count=1,
                            device_name="probe", accelerator=False)

    @hookimpl
    def omni_shared_device_env(self, info, rank, backend):
        return {"OMNI_TEST_SHARED": f"{backend}-{rank}"}


plugin = SharingProbe()
"""


def test_ranks_sharing_a_device_take_the_environment_their_platform_names(tmp_path, monkeypatch):
    """A rank that shares its device sets its platform's ``omni_shared_device_env`` answer before
    ``init_process_group`` (CUDA with NCCL: a host id per rank); ranks with a device each set nothing. The
    platform is a real installed distribution that the spawned workers find through its entry point."""
    site = tmp_path / "site"
    info = site / "sharing_probe-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sharing-probe\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[omni.platforms]\nsharing_probe = sharing_probe_mod:plugin\n")
    (site / "sharing_probe_mod.py").write_text(PROBE_PLATFORM)
    monkeypatch.syspath_prepend(str(site))  # spawned workers start from this process's sys.path
    monkeypatch.delenv("OMNI_TEST_SHARED", raising=False)
    run = lambda devices: launch("workers:sharing_report", Degrees(tp=2), platform="sharing_probe",  # noqa: E731
                                 devices=devices, timeout_s=60)
    assert run(1) == [(True, "gloo-0"), (True, "gloo-1")]
    assert run(2) == [(False, None), (False, None)]


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_nccl_platforms_give_each_rank_sharing_a_gpu_its_own_host_id(vendor):
    """CUDA's NCCL and ROCm's RCCL (both behind the ``nccl`` backend) take the host hash from NCCL_HOSTID."""
    import importlib

    platform = importlib.import_module(f"omni.platforms.{vendor}.plugin").plugin
    ids = {platform.omni_shared_device_env(None, rank, "nccl")["NCCL_HOSTID"] for rank in range(4)}
    assert len(ids) == 4, "NCCL takes ranks with one host id and one bus id for a duplicate device"
    assert platform.omni_shared_device_env(None, 0, "gloo") is None, "gloo: the reference's answer (nothing)"


def test_platforms_without_a_host_id_backend_leave_sharing_to_the_reference():
    from omni.platforms.npu.plugin import plugin as npu

    assert npu.omni_shared_device_env(None, 0, "hccl") is None
