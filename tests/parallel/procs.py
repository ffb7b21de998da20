"""Process checks the launcher and serving tests share: is a PID alive, wait until PIDs are gone, what a process
tree is doing (for the message of a test that timed out)."""
from __future__ import annotations

import os
import time
from pathlib import Path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The PIDs still alive after ``timeout`` seconds (empty when all are gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def describe(pid: int) -> str:
    """``pid`` and its descendants, a line each: state, kernel wait channel and command line, then the load
    average, so a process that did not stop says whether it was waiting, running or stopped."""
    lines = []
    for p in [pid, *descendants(pid)]:
        try:
            state = Path(f"/proc/{p}/stat").read_text().split()[2]
            wchan = Path(f"/proc/{p}/wchan").read_text() or "-"
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
            threads = sum(1 for _ in Path(f"/proc/{p}/task").iterdir())
        except (FileNotFoundError, ProcessLookupError):
            continue
        lines.append(f"pid {p} state {state} wchan {wchan} threads {threads}: {cmd}")
    return "\n".join([*lines, f"load average: {Path('/proc/loadavg').read_text().strip()}"])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of any of its threads, recursively)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found
