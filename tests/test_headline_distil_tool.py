"""``bench/headline_distil.py`` on the raw files of two H200 Distil runs that bench/results keeps (fourteenth and
forty-sixth sessions): the figures it writes are the ones entered in headline.json, it refuses a run of another
configuration naming the field, and it keeps every other key of the file."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import headline_distil as tool  # noqa: E402

RESULTS = BENCH / "results"
S14 = RESULTS / "bench32_h200_instruct_distil_capture_c1_c8_s14_2026-12-02.json"
S46 = RESULTS / "bench32_distil_h200_s46_2026-12-06.json"
EARLIER = {"h200x1_fp8_1024_50_cfg_p50_s": 11.58, tool.P50: 8.697, tool.IPH: 3023.8,
           tool.META: {"date": "2026-12-02", "commit": "ba340d5", "note": "eager", "label": "thirteenth",
                       "before": {tool.P50: 12.129}}}


def run(tmp_path, serving=S14, label="fourteenth", headline=EARLIER) -> tuple[int, Path]:
    path = tmp_path / "headline.json"
    path.write_text(json.dumps(headline, indent=1) + "\n")
    rc = tool.main(["--serving", str(serving), "--commit", "1a60742", "--gpu", "1x H200", "--label", label,
                    "--source", "BENCHMARKS.md, s14", "--headline", str(path)])
    return rc, path


def test_the_fourteenth_run_gives_the_figures_entered_by_hand_and_archives_the_earlier(tmp_path):
    rc, path = run(tmp_path)
    out = json.loads(path.read_text())
    meta = out[tool.META]
    assert rc == 0 and (out[tool.P50], out[tool.IPH]) == (8.739, 3024.7)
    assert (meta["p50_s_c1"], meta["images_per_hour_c1"], meta["label"]) == (1.3254, 2712.6, "fourteenth")
    assert meta["thirteenth"] == {tool.P50: 8.697, tool.IPH: 3023.8, "date": "2026-12-02", "commit": "ba340d5",
                                  "note": "eager", "label": "thirteenth"}
    assert meta["before"] == EARLIER[tool.META]["before"] and out["h200x1_fp8_1024_50_cfg_p50_s"] == 11.58
    assert "--set graph.mode=capture" in meta["command"] and "peak 99.64 GiB" in meta["note"]


def test_the_committed_headline_holds_what_the_tool_makes_of_the_forty_sixth_run(tmp_path):
    rc, path = run(tmp_path, serving=S46, label="forty_sixth")
    out, committed = json.loads(path.read_text()), json.loads((RESULTS / "headline.json").read_text())
    assert rc == 0 and (out[tool.P50], out[tool.IPH]) == (committed[tool.P50], committed[tool.IPH]) == (8.63, 3056.9)
    for key in ("p50_s_c1", "images_per_hour_c1", "command", "note"):
        assert out[tool.META][key] == committed[tool.META][key], key
    assert "ready 25.67 s (build 14.69 s, server warm-up 10.96 s)" in out[tool.META]["note"]


@pytest.mark.parametrize("change, field", [
    (lambda s: s["args"].update(steps=50), "args.steps"),
    (lambda s: s["args"].update(full_size_layers=8), "args.full_size_layers"),
    (lambda s: s["levels"].pop(), "levels"),
    (lambda s: s["levels"][1].update(ok=7, errors=["500"]), "levels[c=8].errors")])
def test_another_configuration_exits_2_naming_the_field_and_writes_nothing(tmp_path, capsys, change, field):
    serving = json.loads(S46.read_text())
    change(serving)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(serving))
    rc, path = run(tmp_path, serving=bad)
    assert rc == 2 and field in capsys.readouterr().err
    assert json.loads(path.read_text()) == EARLIER


def test_a_label_the_meta_already_holds_exits_2(tmp_path, capsys):
    rc, path = run(tmp_path, label="before")
    assert rc == 2 and "'before'" in capsys.readouterr().err
    assert json.loads(path.read_text()) == copy.deepcopy(EARLIER)
