"""A multi-rank ``omni-run serve`` while its ranks load: the HTTP server already answers, 503 "starting".

The first rank of each replica connects to the server before it loads its shard, so /health (and any request)
gets a 503 with the reason and Retry-After during the load and the warm-up, not a refused connection that a
load balancer or an orchestrator's probe would take for a dead server. A real server process, real ranks.

The tiny model loads in under a second, so the window seen here is mostly the warm-up (made long). That the
first rank connects before it loads is shown by tests/parallel/test_replicas.py: a load that fails reaches the
router as a dead replica with its reason, where a rank that had not connected yet would fail the launch.
"""
from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from test_serve_interrupt import assert_ready_stop, ctrl_c, rank_processes, start_server, wait_until
from two_ranks import two_rank_recipe

pytestmark = pytest.mark.timeout(180)


def health(port: int) -> httpx.Response | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.TransportError:
        return None


def test_a_multi_rank_server_answers_503_starting_until_its_replicas_are_ready(tmp_path):
    recipe = two_rank_recipe(tmp_path, "cfg")
    # a long warm-up (the replica reports ready after it) keeps the loading window seconds wide on any machine
    recipe.write_text(recipe.read_text().replace("serving:\n", "serving:\n  warmup_steps: 200\n", 1))
    proc, port, err = start_server(recipe, tmp_path)
    try:
        first = wait_until(lambda: health(port), proc, err, "an answer from /health")
        assert first.status_code == 503, f"{first.status_code} {first.text}"
        assert first.json()["status"] == "starting" and "retry-after" in first.headers, first.text
        wait_until(lambda: (r := health(port)) is not None and r.status_code == 200, proc, err, "200 from /health",
                   timeout=150)  # fails the test when it does not come
        # once ready, /metrics carries the replica's scheduler figures, asked of its first rank over the link
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        assert 'omni_kv_pages_total{replica="0"}' in metrics and 'omni_queue_depth{replica="0"} 0.0' in metrics
        assert 'omni_scheduler_steps_total{replica="0"} 0.0' in metrics, "the warm-up's steps are not counted"
        startup = dict(re.findall(r'omni_startup_seconds\{part="(\w+)",replica="0"\} (\S+)', metrics))
        assert startup.keys() == {"build", "warm_up"} and float(startup["warm_up"]) > 0, startup
        for rank in "01":  # each rank's own device (on the cpu: peak RSS), the follower's gathered at the warm-up
            assert f'omni_device_memory_peak_bytes{{rank="{rank}",replica="0"}}' in metrics, rank
        ranks = rank_processes(proc.pid)
        assert len(ranks) == 2, f"expected 2 rank processes, found {ranks}"
        # Ctrl-C on the ready cfg replica (test_serve_interrupt.py does the same for dp 2)
        code, stderr = ctrl_c(proc, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_ready_stop(code, stderr, ranks)
