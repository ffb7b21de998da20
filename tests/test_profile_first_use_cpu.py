"""``bench/profile_first_use.py`` end to end on the embedded Instruct model (CPU, no Triton): the warm-up, a
prompt, and edits whose prefill encodes a reference image. On the GPU the same rows name the Triton kernels each
part compiled; here nothing compiles, which the rows must say rather than leave out."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "profile_first_use.py"


def test_the_first_use_profile_runs_its_prompts_and_edits_on_the_cpu(tmp_path):
    out = tmp_path / "first_use.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--recipe", "cpu_tiny_instruct", "--layers", "0",
                           "--words", "3", "--warm-up", "--edits", "2", "--edit-size", "256x256,192x320",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["warm_up"]["requests"] == ["ImageRequest", "ImageRequest", "TextRequest"]
    (prompt,) = got["requests"]
    assert prompt["words"] == 3 and prompt["kernels_in_prefill"] == [] and prompt["compiled_in_prefill"] == 0
    assert [e["reference"] for e in got["edits"]] == ["256x256", "192x320"]
    for edit in got["edits"]:
        assert edit["prefix_tokens"] > prompt["prefix_tokens"] + 64  # the reference's VAE and ViT tokens
        assert all(edit[f"compiled_in_{part}"] == 0 and edit[f"kernels_in_{part}"] == []
                   for part in ("prefill", "step1", "step2", "decode"))


def test_the_job_start_runs_the_first_prompts_request_whole_after_its_pass(tmp_path):
    out = tmp_path / "job.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--recipe", "cpu_tiny", "--layers", "0", "--words", "3,5",
                           "--warm-up", "job", "--compile-first", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["warm_up"]["requests"] == [] and got["warm_up"]["compile_first"] is True
    assert got["warm_up"]["compile_pass_s"] is None, "the cpu platform has no compile scope: no pass"
    job = got["job"]
    assert job["prefix_tokens"] == got["requests"][0]["prefix_tokens"], "the job is the first prompt's request"
    parts = sum(job[f"{part}_s"] for part in ("prefill", "step1", "step2", "decode"))
    assert job["first_image_s"] > parts > 0 and [r["words"] for r in got["requests"]] == [3, 5]
