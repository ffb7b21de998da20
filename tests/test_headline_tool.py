"""``bench/headline.py`` on the raw files of two H200 headline runs that bench/results keeps (thirty-fourth and
thirtieth sessions): the figures it writes are the ones those sessions entered in headline.json by hand, it refuses
a run of another configuration naming the field, and it keeps every other key of the file."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
spec = importlib.util.spec_from_file_location("headline_tool", BENCH / "headline.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

RESULTS = BENCH / "results"
S34_SERVING = RESULTS / "bench32_h200_fp8_headline_s34_2026-12-05.json"
S34_FAST = RESULTS / "bench_fast_h200_8layers_headline_s34_2026-12-05.json"
S30_FAST = RESULTS / "bench_fast_h200_8layers_headline_s30_2026-12-04.json"  # ran the naive bf16 path too
S46_SERVING = RESULTS / "bench32_headline_h200_s46_2026-12-06.json"
S46_FAST = RESULTS / "bench_fast_h200_s46_2026-12-06.json"  # its argv names the device's output folder
EARLIER = {"date": "2026-12-04", "commit": "0336e9b", "gpu": "1x H200", tool.P50: 11.7, "floor_s": 9.74,
           "naive_s": 50.65, "images_per_hour_c1": 307.6, "images_per_hour_c2": 318.3, "peak_gib": 97.91,
           "time_to_ready_s": 9.33, "issue15_text": {"decode_tokens_per_s_c1_8layers": 52.7},
           tool.META: {"label": "thirty_first", "source": "BENCHMARKS.md, s31", "note": "s31's run"}}


def run(tmp_path, *extra, serving=S34_SERVING, fast=S34_FAST, headline=EARLIER) -> tuple[int, Path]:
    path = tmp_path / "headline.json"
    path.write_text(json.dumps(headline, indent=1) + "\n")
    rc = tool.main(["--serving", str(serving), "--fast", str(fast), "--commit", "0db5e6b", "--gpu", "1x H200",
                    "--label", "thirty_fourth", "--source", "BENCHMARKS.md, s34", "--headline", str(path), *extra])
    return rc, path


def test_the_thirty_fourth_run_gives_the_figures_entered_by_hand_and_archives_the_earlier(tmp_path):
    rc, path = run(tmp_path)
    out = json.loads(path.read_text())
    assert rc == 0
    assert (out[tool.P50], out["floor_s"], out["images_per_hour_c1"], out["images_per_hour_c2"]) == \
        (11.53, 9.61, 312.1, 322.8)
    assert (out["peak_gib"], out["time_to_ready_s"], out["date"], out["commit"]) == \
        (97.91, 10.49, "2026-12-05", "0db5e6b")
    assert out["naive_s"] == 50.65 and out["naive_s_from"] == "commit 0336e9b"  # --no-naive: carried over
    assert out["issue15_text"] == EARLIER["issue15_text"]
    meta = out[tool.META]
    assert meta["thirty_first"][tool.P50] == 11.7 and meta["thirty_first"]["note"] == "s31's run"
    assert meta["label"] == "thirty_fourth" and "median 1.140x" in meta["note"]
    assert "--full-size-layers 32" in meta["command"] and "(the build only)" in meta["note"]


def test_a_run_with_the_naive_path_replaces_naive_s(tmp_path):
    rc, path = run(tmp_path, fast=S30_FAST)
    out = json.loads(path.read_text())
    assert rc == 0 and out["naive_s"] == 50.65 and out["naive_s_from"] == "this run"
    assert out["floor_s"] == 9.96  # the thirtieth session's floor, as headline.json recorded it then


@pytest.mark.parametrize("change, field", [
    (lambda s: s["args"].update(steps=30), "args.steps"),
    (lambda s: s["args"].update(full_size_layers=8), "args.full_size_layers"),
    (lambda s: s["args"].update(warmup=0), "args.warmup"),
    (lambda s: s["levels"].pop(), "levels: has concurrency [1]"),
    (lambda s: s["levels"][0].update(ok=3, errors={"RuntimeError": 1}), "levels[c=1].errors"),
])
def test_another_configuration_exits_2_naming_the_field_and_writes_nothing(tmp_path, capsys, change, field):
    serving = copy.deepcopy(json.loads(S34_SERVING.read_text()))
    change(serving)
    bad = tmp_path / "bench32.json"
    bad.write_text(json.dumps(serving))
    rc, path = run(tmp_path, serving=bad)
    assert rc == 2 and f"{bad} {field}" in capsys.readouterr().err
    assert json.loads(path.read_text()) == EARLIER


def test_a_bench_fast_run_without_the_engine_step_exits_2_naming_the_field(tmp_path, capsys):
    fast = copy.deepcopy(json.loads(S34_FAST.read_text()))
    del fast["summary"]["engine_fp8"]
    bad = tmp_path / "bench_fast.json"
    bad.write_text(json.dumps(fast))
    rc, path = run(tmp_path, fast=bad)
    assert rc == 2 and f"{bad} summary.engine_fp8" in capsys.readouterr().err
    assert json.loads(path.read_text()) == EARLIER


def test_a_run_of_the_current_bench_names_its_build_and_warm_up_in_the_note(tmp_path):
    """The bench since the thirty-seventh session: time_to_ready_s includes the server's warm-up (``ready``)."""
    ready = {"build_s": 10.4912, "warm_up_s": 8.1, "compile_pass_s": 2.6}
    path = tmp_path / "bench32.json"
    path.write_text(json.dumps(json.loads(S34_SERVING.read_text()) | {"time_to_ready_s": 18.6, "ready": ready}))
    rc, out = run(tmp_path, serving=path)
    written = json.loads(out.read_text())
    assert rc == 0 and written["time_to_ready_s"] == 18.6
    assert "ready 18.6 s (build 10.49 s, server warm-up 8.10 s)" in written[tool.META]["note"]


@pytest.mark.parametrize("label", ["thirty_first", "source"])
def test_a_label_the_meta_already_holds_exits_2_and_writes_nothing(tmp_path, capsys, label):
    """The label names the new run; the replaced run is archived under its own (``thirty_first`` here)."""
    rc, path = run(tmp_path, "--label", label)
    assert rc == 2 and f"--label {label!r} already names an entry" in capsys.readouterr().err
    assert json.loads(path.read_text()) == EARLIER


def test_dry_run_writes_nothing(tmp_path):
    rc, path = run(tmp_path, "--dry-run")
    assert rc == 0 and json.loads(path.read_text()) == EARLIER


def test_the_forty_sixth_run_gives_its_figures_and_a_command_without_the_devices_paths(tmp_path):
    rc, path = run(tmp_path, serving=S46_SERVING, fast=S46_FAST)
    out = json.loads(path.read_text())
    assert rc == 0
    assert (out[tool.P50], out["floor_s"], out["time_to_ready_s"], out["images_per_hour_c2"]) == \
        (11.58, 9.33, 22.98, 321.6)
    assert "/root/out" in " ".join(json.loads(S46_FAST.read_text())["argv"])
    command = out[tool.META]["command"]
    assert "/root/out" not in command and command.endswith("--floor-rounds 3 --json out.json")
    assert "median 1.145x" in out[tool.META]["note"]
