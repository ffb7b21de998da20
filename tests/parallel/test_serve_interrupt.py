"""Ctrl-C on a multi-rank ``omni-run serve``: a real server process, its real rank processes, a real SIGINT.

A terminal's Ctrl-C signals the whole foreground process group (the server and every rank it launched), so
the tests send SIGINT to the group, not just to the server. The multi-rank server must end as the
single-process one does (tests/serving/test_cli_serve.py): exit status 0, nothing alarming on stderr, and
no rank process left behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from procs import descendants, describe, wait_gone
from two_ranks import two_rank_recipe
from omni.parallel.launch import free_port

pytestmark = pytest.mark.timeout(120)
ALARMS = ("Traceback", "EOFError", "ERROR", "Fatal Python error", "leaked semaphore")


def start_server(recipe: Path, tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    err = tmp_path / "stderr.txt"
    with err.open("w") as f:  # a file, not a pipe: nothing reads stderr while the server runs
        # its own session: the test's SIGINT to the group is a Ctrl-C that reaches this server's processes only
        proc = subprocess.Popen([sys.executable, "-m", "omni.cli", "serve", "--recipe", str(recipe), "--port",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=f, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc, port, err


def rank_processes(pid: int) -> list[int]:
    """The spawned workers (multiprocessing's resource tracker, also a child, is not one)."""
    ranks = []
    for child in descendants(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                ranks.append(child)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return ranks


def wait_until(condition, proc: subprocess.Popen, err: Path, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert proc.poll() is None, f"the server exited ({proc.returncode}) before {what}:\n{err.read_text()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s:\n{err.read_text()}"
        time.sleep(0.1)


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def ctrl_c(proc: subprocess.Popen, err: Path) -> tuple[int, str]:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        tree = describe(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the server did not stop within 30 s of Ctrl-C:\n{err.read_text()}\nprocesses then:\n{tree}")
    return code, err.read_text()


def assert_quiet(stderr: str) -> None:
    alarms = [line for line in stderr.splitlines() if any(a in line for a in ALARMS)]
    assert not alarms, f"stderr after Ctrl-C:\n{stderr}"


def assert_ready_stop(code: int, stderr: str, ranks: list[int]) -> None:
    """A ready server stopped by Ctrl-C: exit 0, no traceback, uvicorn's orderly stop, no rank left behind."""
    assert code == 0, f"exit status {code} (single-process serve exits 0 on Ctrl-C):\n{stderr}"
    assert_quiet(stderr)
    assert "Shutting down" in stderr  # uvicorn's orderly stop, not a crash
    assert wait_gone(ranks) == [], "rank processes outlived the server"


def test_ctrl_c_stops_a_ready_multi_rank_server_cleanly(tmp_path):
    """dp 2: two one-rank replicas behind the router. One replica of two ranks in lock-step (cfg 2) is stopped
    the same way, once ready, by test_serve_loading.py."""
    proc, port, err = start_server(two_rank_recipe(tmp_path, "dp"), tmp_path)
    try:
        wait_until(lambda: healthy(port), proc, err, "200 from /health")
        ranks = rank_processes(proc.pid)
        assert len(ranks) == 2, f"expected 2 rank processes, found {ranks}"
        code, stderr = ctrl_c(proc, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_ready_stop(code, stderr, ranks)


def test_ctrl_c_while_the_ranks_load_stops_them(tmp_path):
    """Before the replicas connect the CLI's interrupt status (130) applies; no rank may be left behind."""
    proc, _, err = start_server(two_rank_recipe(tmp_path, "cfg"), tmp_path)

    def both_ranks() -> list[int] | None:
        ranks = rank_processes(proc.pid)
        return ranks if len(ranks) == 2 else None

    try:
        # Ctrl-C as soon as both ranks exist: they are still starting Python and importing torch, seconds
        # away from connecting to the server
        ranks = wait_until(both_ranks, proc, err, "two rank processes")
        code, stderr = ctrl_c(proc, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 130, f"exit status {code}:\n{stderr}"
    assert_quiet(stderr)
    assert wait_gone(ranks) == [], "rank processes outlived the server"
