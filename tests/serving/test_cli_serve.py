"""``omni-run serve`` and ``omni-run bench`` as a user runs them: a real process, the real tiny model."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from omni.bench_client import bench_main, percentile
from serving_harness import free_port, wait_healthy


@pytest.fixture(scope="module")
def server_process():
    port = free_port()
    cmd = [sys.executable, "-m", "omni.cli", "--port", str(port)]  # no command: serves, as the help says
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 120, "server did not become healthy")
    yield url, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_serve_binds_localhost_and_bench_measures_it(server_process, tmp_path):
    url, proc = server_process
    out = tmp_path / "bench.json"
    rc = bench_main(["--url", url, "--concurrency", "2", "--requests", "2", "--steps", "1", "--guidance", "1",
                     "--warmup", "0", "--sizes", "1024x1024,1280x768", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    [level] = report["levels"]
    assert level["ok"] == 2 and level["latency_s"]["p50"] > 0 and level["images_per_hour"] > 0
    assert level["stage_mean_s"]["vae"] > 0 and level["stage_mean_s"]["denoise"] > 0
    assert level["device_memory_reserved_bytes"] is None  # read from its /metrics: a cpu server reports none
    ready = report["ready"]  # the server's omni_startup_seconds: it built, then warmed up (no pass on the cpu)
    assert ready["build_s"] > 0 and ready["warm_up_s"] > 0 and ready["compile_pass_s"] is None


def test_bench_reads_a_servers_reserved_memory_from_its_metrics():
    """Against a URL the level's reserved memory is the server's ``omni_device_memory_reserved_bytes`` (what a
    GPU server's /metrics reports; here a stand-in serving that text, as the cpu platform has no allocator),
    summed over a multi-rank server's replicas and ranks; an answer without it, or a refused scrape, leaves the
    figure out."""
    import http.server

    from omni.bench_client import HttpTarget

    pages = {"/metrics": (200, "omni_device_memory_peak_bytes 1.0e+10\nomni_device_memory_reserved_bytes "
                                "1.1853e+11\nomni_queue_depth 0.0\n")}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, text = pages.get(self.path, (404, ""))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        target = HttpTarget(f"http://127.0.0.1:{server.server_address[1]}", None, 10)
        assert target.reserved_memory() == 118_530_000_000
        pages["/metrics"] = (200, "".join(f'omni_device_memory_reserved_bytes{{rank="{k}",replica="{i}"}} '
                                          f"{1e9 * (1 + k + 2 * i):.1e}\n" for i in range(2) for k in range(2)))
        assert target.reserved_memory() == int(1e9 * (1 + 2 + 3 + 4))  # two tp2 replicas: four devices
        pages["/metrics"] = (200, "omni_device_memory_peak_bytes 1.0e+10\n")
        assert target.reserved_memory() is None
        pages["/metrics"] = (401, "omni_device_memory_reserved_bytes 5\n")
        assert target.reserved_memory() is None
        pages["/metrics"] = (200, "".join(f'omni_startup_seconds{{part="{p}",replica="{i}"}} {i + s}\n'
                                          for i in range(2) for p, s in (("build", 40.5), ("warm_up", 8.25))))
        assert target.startup() == {"build_s": 40.5, "warm_up_s": 8.25, "compile_pass_s": None}  # replica 0
        server.shutdown()


def test_sigint_answers_the_running_request_503_and_logs_no_traceback(server_process):
    """Ctrl-C while a request runs: its client gets a 503 in the OpenAI shape with Retry-After at once (not a
    plain-text 500 after the drain timeout), the process exits 0 and its log has no traceback."""
    url, proc = server_process
    answer = {}

    def post():
        answer["r"] = httpx.post(url + "/v1/images/generations", timeout=120,
                                 json={"prompt": "a long one", "num_inference_steps": 200, "guidance_scale": 5.0})

    client = threading.Thread(target=post)
    client.start()
    startup = dict(re.findall(r'omni_startup_seconds\{part="(\w+)"\} (\S+)', httpx.get(url + "/metrics").text))
    assert startup.keys() == {"build", "warm_up"} and all(float(v) > 0 for v in startup.values()), startup
    deadline = time.monotonic() + 60
    while "omni_running_requests 1.0" not in httpx.get(url + "/metrics").text:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    client.join(60)
    r = answer["r"]
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "server_error"
    assert proc.wait(30) == 0
    log = proc.stdout.read()
    assert "http://127.0.0.1:" in log and "Traceback" not in log and "CancelledError" not in log, log
    assert "warm-up done in" in log, "the server warms up before it reports ready (serving.warmup_steps)"
    assert re.search(r"ready in \d+\.\d s \(build \d+\.\d s, warm up \d+\.\d s\)", log), log


def test_serve_on_a_port_in_use_exits_2_before_loading_anything():
    """The address is bound first: a port another process listens on ends the run at once with exit status 2
    and the address in the message, before any weight loads (it used to load, warm up, then exit 3)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "omni.cli", "--port", str(port), "serve"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 2, proc.stderr
    assert f"omni-run: error: cannot listen on 127.0.0.1:{port} (--host/--port, serving.host/serving.port): " \
           in proc.stderr and "in use" in proc.stderr
    assert "pipeline ready" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_bench_against_a_url_nobody_serves_exits_2_naming_it(capsys):
    from omni.cli import main

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "--url", url, "--requests", "1", "--concurrency", "1"]) == 2
    err = capsys.readouterr().err
    assert f"omni-run: error: --url {url}: cannot reach {url}/health (ConnectError: " in err


def test_bench_in_process(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench_main(["--recipe", "cpu_tiny", "--concurrency", "1", "--requests", "1", "--steps", "1",
                     "--guidance", "1", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    [level] = report["levels"]
    assert level["ok"] == 1 and level["peak_device_memory_bytes"] > 0
    assert level["device_memory_reserved_bytes"] is None  # the CPU has no caching allocator to report
    ready = report["ready"]  # built as `serve` builds it: the server's warm-up ran before ready
    assert ready["warm_up_s"] > 0 and ready["compile_pass_s"] is None  # the reference compiles nothing
    assert ready["build_s"] + ready["warm_up_s"] == pytest.approx(report["time_to_ready_s"], abs=0.05)
    assert report["host"]["device"] == "CPU (reference PyTorch)" and report["host"]["torch"]


def test_bench_in_process_without_the_server_warm_up_counts_the_build_alone(tmp_path):
    out = tmp_path / "bench.json"
    rc = bench_main(["--recipe", "cpu_tiny", "--concurrency", "1", "--requests", "1", "--steps", "1", "--warmup",
                     "0", "--no-server-warm-up", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["ready"]["warm_up_s"] is None
    assert report["ready"]["build_s"] == pytest.approx(report["time_to_ready_s"], abs=0.05)


def test_bench_in_process_over_launched_ranks_reports_the_replicas_ready_split(tmp_path):
    """tp2 on gloo: the ranks build and warm up in their own processes; the replica reports its parts over its
    link, within the total measured here."""
    out = tmp_path / "bench.json"
    rc = bench_main(["--recipe", "cpu_tiny", "--set", "parallel.tp=2", "--set", "device.count=2", "--concurrency",
                     "1", "--requests", "1", "--steps", "1", "--sizes", "256x256", "--warmup", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["levels"][0]["ok"] == 1 and report["time_to_ready_s"] > 0
    ready = report["ready"]
    assert ready["build_s"] > 0 and ready["warm_up_s"] > 0 and ready["compile_pass_s"] is None
    assert ready["build_s"] + ready["warm_up_s"] < report["time_to_ready_s"]


def test_bench_full_size_layers_refuses_a_parallel_layout_with_exit_2_naming_the_tool(tmp_path, capsys):
    from omni.cli import main

    assert main(["bench", "--recipe", "cpu_tiny", "--full-size-layers", "1", "--set", "parallel.tp=2", "--set",
                 "device.count=2", "--json", str(tmp_path / "b.json")]) == 2
    assert "--full-size-layers builds one process's engine; recipe cpu_tiny has world size 2: " \
           "bench/bench_parallel.py" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
