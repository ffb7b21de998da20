"""bench/bench_step_cache.py on a very small config: the reference and a skip-everything threshold."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # a bench smoke (~35 s on 2 cores): python -m pytest -m slow

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_step_cache.py"
STEPS = 4


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_step_cache", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_bench()


@pytest.fixture(scope="module")
def rows(bench, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no oversubscription when the (small) host is busy
    try:
        pipe = bench.build(cache_dir=tmp_path_factory.mktemp("tiny") / "ckpt")
        return bench.measure(pipe, bench.PROMPTS[:1], [0.0, 10.0], steps=STEPS, width=512, height=512, warmup=False)
    finally:
        torch.set_num_threads(threads)


def test_reference_skips_nothing_and_matches_itself(rows):
    ref = rows[0]
    assert ref["threshold"] == 0.0 and ref["skipped_min"] == ref["skipped_max"] == 0
    assert ref["psnr_mean"] == ref["psnr_min"] == math.inf
    assert ref["ssim_mean"] == pytest.approx(1.0, abs=1e-12) and ref["ssim_min"] == pytest.approx(1.0, abs=1e-12)
    assert ref["denoise_speedup"] == pytest.approx(1.0)


def test_threshold_nothing_crosses_skips_every_middle_step(rows):
    cached = rows[1]
    assert cached["threshold"] == 10.0
    assert cached["skipped_min"] == cached["skipped_max"] == STEPS - 2  # the first and the last step always run
    assert math.isfinite(cached["psnr_mean"]) and cached["psnr_min"] == cached["psnr_mean"]
    assert -1.0 <= cached["ssim_min"] < 1.0
    assert cached["denoise_s_mean"] > 0 and cached["wall_s_mean"] >= cached["denoise_s_mean"]


def test_table_and_json_render(bench, rows):
    text = bench.table(rows)
    assert text.count("\n") == 3 and f"| 10 | {STEPS - 2} of {STEPS} |" in text and "| inf / inf |" in text
    dumped = json.loads(json.dumps(bench.finite(rows)))  # strict JSON: no Infinity
    assert dumped[0]["psnr_mean"] is None and dumped[1]["psnr_mean"] == rows[1]["psnr_mean"]
