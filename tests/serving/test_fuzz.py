"""schemathesis against the embedded default's /openapi.json: no server error, no conformance failure.

Deselected by default (marker ``fuzz``, about 10 minutes on a 2-core box)::

    pip install 'omni-run[fuzz]'
    python -m pytest -m fuzz tests/serving/test_fuzz.py

It starts ``fuzz_server.py`` (the tiny base model made cheap to say yes to; its
caps are in the OpenAPI document it serves) and runs every check schemathesis
has (``--checks all``: server errors, status codes, content types, response
headers and schemas, positive data accepted, negative data rejected, response
time, ...) in all its phases (examples, coverage, fuzzing, stateful; positive
and negative modes), with ``fuzz_hooks.py`` loaded (``SCHEMATHESIS_HOOKS``): it
draws real images for the edit form's image part and a chat's image_url, and
works around two schemathesis verdicts on forms with a file part.
``OMNI_FUZZ_SECONDS`` (default 600) bounds the run,
``OMNI_FUZZ_MIN_CASES`` (default 30000) is the number of cases it must reach,
``OMNI_FUZZ_SEED`` (default 4, the recorded run's) picks the data: another seed explores other inputs;
``OMNI_FUZZ_RECIPE`` (default cpu_tiny) picks the model: cpu_tiny_instruct adds editing, text answers and CoT;
``OMNI_FUZZ_FULL_EDITS=1`` keeps edits whole (the fuzz server's ``--full-edits``: the real VAE encoder for the
references and the model's own max_images, 3) and raises schemathesis' response-time limit from its default
10 s (on with ``--checks all``) to ``fuzz_server.FULL_EDITS_MAX_RESPONSE_S``, which such edits fit.
A failure shows schemathesis' report from its first failure on (long lines cut); the whole output is
``schemathesis.txt`` in the test's tmp_path. After the figures it prints the accepted edits by their number of
reference images (the fuzz server's ``--edit-counts``; the edit form takes 1..max_images files).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fuzz_server import FULL_EDITS_MAX_RESPONSE_S
from serving_harness import free_port, wait_healthy

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(3600)]
HERE = Path(__file__).parent
FULL_EDITS = os.environ.get("OMNI_FUZZ_FULL_EDITS") == "1"


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """(url, path of the accepted edits by reference count, JSON) of a fuzz server started for the module."""
    port = free_port()
    recipe = os.environ.get("OMNI_FUZZ_RECIPE", "cpu_tiny")
    counts = tmp_path_factory.mktemp("fuzz_server") / "edit_counts.json"
    proc = subprocess.Popen([sys.executable, str(HERE / "fuzz_server.py"), str(port), recipe,
                             *(["--full-edits"] if FULL_EDITS else []), "--edit-counts", str(counts)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 180, "the fuzz server did not become healthy", poll_s=0.5)
    log = open(counts.with_name("server.log"), "w")  # drained as it comes: a full pipe would block the server
    threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, log), daemon=True).start()
    yield url, counts
    proc.terminate()
    proc.wait(30)
    log.close()


def test_schemathesis_finds_no_server_error_and_no_conformance_failure(fuzz_server, tmp_path):
    fuzz_url, counts = fuzz_server
    cli = shutil.which("schemathesis") or pytest.skip("schemathesis is not installed: pip install 'omni-run[fuzz]'")
    seconds = os.environ.get("OMNI_FUZZ_SECONDS", "600")
    least = int(os.environ.get("OMNI_FUZZ_MIN_CASES", "30000"))
    seed = os.environ.get("OMNI_FUZZ_SEED", "4")
    cmd = [cli, "run", fuzz_url + "/openapi.json", "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
           "--mode", "all", "-n", "3000", "--max-time", seconds, "--seed", seed, "--request-timeout", "60",
           "--no-shrink", *(["--max-response-time", str(FULL_EDITS_MAX_RESPONSE_S)] if FULL_EDITS else [])]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks",  # real images where the API takes them (fuzz_hooks.py)
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)
    out = run.stdout + run.stderr
    (tmp_path / "schemathesis.txt").write_text(out)  # whole, for a failure's body (pytest keeps the last 3 runs)
    cases = re.search(r"(\d+) generated, (\d+) passed", out)  # "N generated, K found ..." when some failed
    assert run.returncode == 0 and cases and cases[1] == cases[2], f"{report(out)}\n(all of it: {tmp_path})"
    assert int(cases[1]) >= least, f"only {cases[1]} cases in {seconds}s (wanted {least})"
    print(out.split("Test cases:")[-1].strip())  # the figures (python -m pytest -m fuzz -s shows them)
    edits = json.loads(counts.read_text()) if counts.exists() else {}
    print("accepted edits by reference count:", edits or "none")


def report(out: str, width: int = 400) -> str:
    """schemathesis' output from its first failure or error on, each line cut to ``width`` characters: a
    failing case's body (megabytes of fuzzed JSON) would otherwise push the other failures out of sight."""
    start = min((i for i in (out.find("= FAILURES ="), out.find("= ERRORS =")) if i >= 0), default=0)
    start = out.rfind("\n", 0, start) + 1
    return "\n".join(line if len(line) <= width else line[:width] + " [...]" for line in out[start:].splitlines())
