"""Merge one Distil headline measurement into ``bench/results/headline.json`` (issue 16, item 5).

The Distil headline is one command on one H200, the recipe as shipped (8 steps, guidance as a token):

    omni-run bench --recipe h200_instruct_distil_fp8 --platform cuda --full-size-layers 32 \\
        --set device.memory_gib=139 --concurrency 1,8 --requests 8 --sizes 1024x1024 --warmup 1 --json distil.json

This reads its JSON, checks that it is that configuration (32 layers, 1024x1024, the recipe's own steps, levels 1
and 8, at least 3 images at c=1 after a warm-up, none failed; a file that is not says which field and exits 2),
and writes ``h200x1_distil_1024_8_p50_s`` (p50 with 8 requests at once) and
``h200x1_distil_images_per_hour_c8``, with the c=1 figures, the command and a note in ``h200x1_distil_meta``.
The values they replace move, with their meta, under ``h200x1_distil_meta[<their label>]``; every other key of
the file stays as it was (``bench/headline.py`` does the same for the base model's headline).

    python3 bench/headline_distil.py --serving distil.json --commit 9501a6d --gpu "1x NVIDIA H200 (700 W cap)" \\
        --label forty_sixth_session_9501a6d --source "BENCHMARKS.md, 'Forty-sixth session'" [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from headline import (GIB, HEADLINE, NotTheHeadline, bench_command, check_levels, ready_text,  # noqa: E402
                      refuse_taken, require, write)

P50 = "h200x1_distil_1024_8_p50_s"
IPH = "h200x1_distil_images_per_hour_c8"
META = "h200x1_distil_meta"
RUN_KEYS = ("date", "commit", "gpu", "command", "note", "source", "p50_s_c1", "images_per_hour_c1", "label")
SERVING_ARGS = {"full_size_layers": 32, "sizes": "1024x1024", "guidance": None}


def check(serving: dict, name: str) -> dict[int, dict]:
    """The levels by concurrency, after checking the run is the Distil headline's configuration."""
    args = serving.get("args", {})
    for field, want in SERVING_ARGS.items():
        require(args.get(field) == want, f"{name} args.{field}", f"is {args.get(field)!r}; the headline is {want!r}")
    require(args.get("steps") in (None, 8), f"{name} args.steps", f"is {args.get('steps')!r}; the headline runs "
            "the recipe's 8")
    return check_levels(serving, name, (1, 8))


def note(serving: dict, levels: dict[int, dict]) -> str:
    c1, c8 = levels[1], levels[8]
    stages = c8["stage_mean_s"]
    return (f"{c8['ok']}/{c8['requests']} ok at each level; c=1: p50 {c1['latency_s']['p50']:.3f} s, "
            f"{c1['images_per_hour']} images/h; c=8: p90 {c8['latency_s']['p90']:.2f} s, denoise "
            f"{stages['denoise']:.3f} s, VAE {stages['vae']:.3f} s mean, peak "
            f"{(c8.get('peak_device_memory_bytes') or 0) / GIB:.2f} GiB, reserved "
            f"{(c8.get('device_memory_reserved_bytes') or 0) / GIB:.2f} GiB; {ready_text(serving)}")


def merge(headline: dict, serving: dict, *, name: str, commit: str, gpu: str, label: str, source: str) -> dict:
    """``headline`` with this run's values (checked first: NotTheHeadline), the replaced ones archived."""
    levels = check(serving, name)
    meta = headline.setdefault(META, {})
    refuse_taken(meta, label, META)
    if P50 in headline:  # archive the run this one replaces
        old = {k: headline[k] for k in (P50, IPH)} | {k: meta.pop(k) for k in RUN_KEYS if k in meta}
        meta[old.get("label") or f"commit_{old.get('commit')}"] = old
    headline[P50] = round(levels[8]["latency_s"]["p50"], 3)
    headline[IPH] = levels[8]["images_per_hour"]
    meta.update(date=serving["date"][:10], commit=commit, gpu=gpu, command=bench_command(serving["args"]),
                note=note(serving, levels), source=source, p50_s_c1=round(levels[1]["latency_s"]["p50"], 4),
                images_per_hour_c1=levels[1]["images_per_hour"], label=label)
    return headline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serving", type=Path, required=True, help="omni-run bench's JSON (the 32-layer Distil sweep)")
    p.add_argument("--commit", required=True, help="the tree it ran on (the device copy's git may be stale)")
    p.add_argument("--gpu", required=True, help="the card and stack, e.g. '1x NVIDIA H200 (700 W cap), torch ...'")
    p.add_argument("--label", required=True, help="this run's name in the meta once a later run replaces it (new)")
    p.add_argument("--source", required=True, help="where BENCHMARKS.md describes the run")
    p.add_argument("--headline", type=Path, default=HEADLINE, help=f"the file to update (default {HEADLINE})")
    p.add_argument("--dry-run", action="store_true", help="print the new values; write nothing")
    a = p.parse_args(argv)
    try:
        serving, headline = json.loads(a.serving.read_text()), json.loads(a.headline.read_text())
        merge(headline, serving, name=str(a.serving), commit=a.commit, gpu=a.gpu, label=a.label, source=a.source)
    except (OSError, json.JSONDecodeError, NotTheHeadline) as e:
        print(f"headline_distil: error: {e}", file=sys.stderr)
        return 2
    shown = {k: headline[k] for k in (P50, IPH)} | {k: headline[META][k] for k in RUN_KEYS}
    return write(a.headline, headline, shown, a.dry_run)


if __name__ == "__main__":
    sys.exit(main())
