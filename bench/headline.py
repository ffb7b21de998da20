"""Merge one headline measurement into ``bench/results/headline.json`` (issue 17, item 5).

The headline is two commands on one H200, one after the other on the same machine:

    omni-run bench --recipe h200_fp8 --platform cuda --full-size-layers 32 --set device.memory_gib=139 \\
        --concurrency 1,2 --requests 4 --sizes 1024x1024 --steps 50 --guidance 5 --warmup 1 --json bench32.json
    python3 bench/bench_fast.py --layers 8 --timed 8 --fast-accum --no-vae --json bench_fast.json

This reads their two JSON files, checks that they are that configuration (32 layers, 1024x1024, 50 steps,
guidance 5, levels 1 and 2, at least 3 images after a warm-up at c=1, none failed; a file that is not says which
field and exits 2), and writes the issue's keys: ``date``, ``commit``, ``gpu``, ``h200x1_fp8_1024_50_cfg_p50_s``,
``floor_s``, ``naive_s``, ``images_per_hour_c1``, ``images_per_hour_c2``, ``peak_gib``, ``time_to_ready_s``
(and the reserved memory and the sustained floor beside them). The values they replace move, with their
``source``, ``command`` and ``note``, under ``h200x1_fp8_1024_50_cfg_meta[<their label>]``; every other key of
the file stays as it was. A bench_fast run without the naive path (``--no-naive``) keeps the previous
``naive_s`` and says in ``naive_s_from`` where it came from.

    python3 bench/headline.py --serving bench32.json --fast bench_fast.json --commit 0db5e6b \\
        --gpu "1x NVIDIA H200 (700 W cap), torch 2.11.0+cu130" --label thirty_seventh_session \\
        --source "BENCHMARKS.md, 'Thirty-seventh session'" [--note "..."] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HEADLINE = Path(__file__).resolve().parent / "results" / "headline.json"
P50 = "h200x1_fp8_1024_50_cfg_p50_s"
META = "h200x1_fp8_1024_50_cfg_meta"
RESERVED = "h200x1_fp8_1024_50_cfg_reserved_gib"
SUSTAINED = "h200x1_fp8_1024_50_cfg_floor_sustained_s"
VALUES = ("date", "commit", "gpu", P50, "floor_s", "naive_s", "naive_s_from", "images_per_hour_c1",
          "images_per_hour_c2", "peak_gib", "time_to_ready_s", RESERVED, SUSTAINED)
SERVING_ARGS = {"full_size_layers": 32, "sizes": "1024x1024", "steps": 50, "guidance": 5.0}
FAST_FIELDS = {"size": "1024x1024", "steps": 50, "cfg": 5.0}
MIN_IMAGES = 3
GIB = 2 ** 30


class NotTheHeadline(ValueError):
    """A file that is not the headline's configuration; the message names the file and the field."""


def require(ok: bool, where: str, why: str) -> None:
    if not ok:
        raise NotTheHeadline(f"{where}: {why}")


def check_serving(serving: dict, name: str) -> dict[int, dict]:
    """The serving sweep's levels by concurrency, after checking it is the headline's configuration."""
    args = serving.get("args", {})
    for field, want in SERVING_ARGS.items():
        require(args.get(field) == want, f"{name} args.{field}", f"is {args.get(field)!r}; the headline is {want!r}")
    return check_levels(serving, name, (1, 2))


def check_levels(serving: dict, name: str, need: tuple[int, ...]) -> dict[int, dict]:
    """A sweep's levels by concurrency: after a warm-up, levels ``need`` there, no request failed, and enough
    images at c=1 for a p50."""
    require((serving.get("args", {}).get("warmup") or 0) >= 1, f"{name} args.warmup",
            "is 0; the headline is after a warm-up")
    levels = {lv["concurrency"]: lv for lv in serving.get("levels", [])}
    require(set(need) <= set(levels), f"{name} levels",
            f"has concurrency {sorted(levels)}; the headline needs {' and '.join(map(str, need))}")
    for c, lv in levels.items():
        require(lv["ok"] == lv["requests"], f"{name} levels[c={c}].errors", f"{lv['errors']}: a request failed")
    require(levels[1]["ok"] >= MIN_IMAGES, f"{name} levels[c=1].requests",
            f"is {levels[1]['ok']}; p50 needs at least {MIN_IMAGES} images")
    return levels


def refuse_taken(meta: dict, label: str, where: str) -> None:
    """A new run's label must be new: archiving a later run under a taken one would overwrite an entry."""
    if label in meta or label == meta.get("label"):
        raise NotTheHeadline(f"--label {label!r} already names an entry of {where}: it names this run, "
                             "so it must be new")


def check_fast(fast: dict, name: str) -> None:
    for field, want in FAST_FIELDS.items():
        require(fast.get(field) == want, f"{name} {field}", f"is {fast.get(field)!r}; the headline is {want!r}")
    require("fp8" in fast.get("floor", {}), f"{name} floor.fp8", "is missing (bench_fast ran without --floor?)")
    require("engine_fp8" in fast.get("summary", {}), f"{name} summary.engine_fp8", "is missing (the engine's fp8 "
            "step did not run)")


def serving_values(serving: dict, levels: dict[int, dict]) -> dict:
    peaks = [lv.get("peak_device_memory_bytes") or 0 for lv in levels.values()]
    reserved = [lv.get("device_memory_reserved_bytes") or 0 for lv in levels.values()]
    return {P50: round(levels[1]["latency_s"]["p50"], 2), "images_per_hour_c1": levels[1]["images_per_hour"],
            "images_per_hour_c2": levels[2]["images_per_hour"], "peak_gib": round(max(peaks) / GIB, 2),
            RESERVED: round(max(reserved) / GIB, 2), "time_to_ready_s": serving["time_to_ready_s"]}


def fast_values(fast: dict, previous: dict) -> dict:
    """floor_s and the sustained floor from this run; naive_s from it, else carried over with its origin."""
    floor, steps = fast["floor"]["fp8"], fast["steps"]
    out = {"floor_s": round(floor["image_s"], 2), SUSTAINED: round(floor["sustained"]["step_32_layers_s"] * steps, 2)}
    naive = fast.get("summary", {}).get("naive_bf16")
    if naive is not None:
        return out | {"naive_s": round(naive["image_s"], 2), "naive_s_from": "this run"}
    origin = previous.get("naive_s_from")
    origin = f"commit {previous.get('commit')}" if origin in (None, "this run") else origin
    return out | {"naive_s": previous.get("naive_s"), "naive_s_from": origin}


def step_note(fast: dict) -> str:
    """The engine step against the floor: first pass, the rounds of the floor timed alone, sustained."""
    engine_s = fast["summary"]["engine_fp8"]["step_32_s"]
    floor = fast["floor"]["fp8"]
    rounds = floor.get("alone_rounds", {}).get("step_32_layers_s", [floor["step_32_layers_s"]])
    ratios = [engine_s / r for r in rounds]
    return (f"engine step {engine_s * 1e3:.1f} ms, floor {floor['step_32_layers_s'] * 1e3:.1f} ms alone "
            f"({ratios[0]:.3f}x; {min(ratios):.3f}-{max(ratios):.3f}x over {len(ratios)} rounds, median "
            f"{statistics.median(ratios):.3f}x) and {floor['sustained']['step_32_layers_s'] * 1e3:.1f} ms sustained "
            f"({engine_s / floor['sustained']['step_32_layers_s']:.3f}x)")


def run_note(serving: dict, fast: dict, levels: dict[int, dict]) -> str:
    c1, c2 = levels[1], levels[2]
    stages = c1["stage_mean_s"]
    return (f"p50 over {c1['ok']} images at c=1 after a warm-up: {c1['latency_s']['p50']:.3f} s (p90 "
            f"{c1['latency_s']['p90']:.2f}, prefill {stages['prefill']:.3f}, denoise {stages['denoise']:.3f}, VAE "
            f"{stages['vae']:.3f}, PNG {stages['encode']:.3f} s); c=2 p50 {c2['latency_s']['p50']:.2f} s; "
            f"{ready_text(serving)}; bench_fast: {step_note(fast)}; random-layer gate "
            f"{fast.get('quality_random_layers', {}).get('gate', 'not run')}")


def ready_text(serving: dict) -> str:
    """The sweep's time to ready, split into the build and the server's warm-up where the bench ran one."""
    ready = serving.get("ready") or {}
    return f"ready {serving['time_to_ready_s']} s" + (
        f" (build {ready['build_s']:.2f} s, server warm-up {ready['warm_up_s']:.2f} s)"
        if ready.get("warm_up_s") is not None else " (the build only)")


def bench_command(a: dict) -> str:
    """The ``omni-run bench`` command of a sweep's recorded ``args`` (``--steps`` / ``--guidance`` where set)."""
    sets = "".join(f" --set {s}" for s in a.get("set", []))
    steps = f" --steps {a['steps']}" if a.get("steps") is not None else ""
    guidance = f" --guidance {a['guidance']:g}" if a.get("guidance") is not None else ""
    return (f"omni-run bench --recipe {a['recipe']} --platform {a['platform']} --full-size-layers "
            f"{a['full_size_layers']}{sets} --concurrency {a['concurrency']} --requests {a['requests']} --sizes "
            f"{a['sizes']}{steps}{guidance} --warmup {a['warmup']} --json out.json")


def command(serving: dict, fast: dict) -> str:
    argv = fast.get("argv")
    return bench_command(serving["args"]) + "; then python3 bench/bench_fast.py " + (
        " ".join(portable(argv)) if argv else "(arguments not recorded)")


def portable(argv: list[str]) -> list[str]:
    """bench_fast's arguments with its ``--json`` path as the bench's (``out.json``): the device's output folder
    means nothing to whoever repeats the command."""
    return [("out.json" if i and argv[i - 1] == "--json" else a) for i, a in enumerate(argv)]


def archive(headline: dict) -> None:
    """The current headline values, with their meta's source, command and note, under meta[their label]."""
    meta = headline.setdefault(META, {})
    old = {k: headline[k] for k in VALUES if k in headline}
    if P50 not in old:
        return
    old |= {k: meta[k] for k in ("source", "command", "note") if k in meta}
    label = meta.get("label") or f"commit_{old.get('commit')}"
    meta[label] = old


def merge(headline: dict, serving: dict, fast: dict, *, serving_name: str, fast_name: str, commit: str, gpu: str,
          label: str, source: str, note: str = "") -> dict:
    """``headline`` with this run's values (checked first: NotTheHeadline), the replaced ones archived."""
    levels = check_serving(serving, serving_name)
    check_fast(fast, fast_name)
    refuse_taken(headline.get(META, {}), label, META)
    values = {"date": serving["date"][:10], "commit": commit, "gpu": gpu} | serving_values(serving, levels)
    values |= fast_values(fast, headline)
    archive(headline)
    headline.update(values)
    text = run_note(serving, fast, levels) + (f". {note}" if note else "")
    headline[META].update(label=label, source=source, command=command(serving, fast), note=text)
    return headline


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serving", type=Path, required=True, help="omni-run bench's JSON (the 32-layer sweep)")
    p.add_argument("--fast", type=Path, required=True, help="bench/bench_fast.py's JSON from the same machine")
    p.add_argument("--commit", required=True, help="the tree both ran on (the device copy's git may be stale)")
    p.add_argument("--gpu", required=True, help="the card and stack, e.g. '1x NVIDIA H200 (700 W cap), torch ...'")
    p.add_argument("--label", required=True, help="this run's name in the meta once a later run replaces it (a new "
                   "one, e.g. thirty_ninth_session_<commit>; not the label of the run it replaces)")
    p.add_argument("--source", required=True, help="where BENCHMARKS.md describes the run")
    p.add_argument("--note", default="", help="appended to the generated note")
    p.add_argument("--headline", type=Path, default=HEADLINE, help=f"the file to update (default {HEADLINE})")
    p.add_argument("--dry-run", action="store_true", help="print the new values; write nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    try:
        serving, fast = (json.loads(f.read_text()) for f in (a.serving, a.fast))
        headline = json.loads(a.headline.read_text())
        merge(headline, serving, fast, serving_name=str(a.serving), fast_name=str(a.fast), commit=a.commit,
              gpu=a.gpu, label=a.label, source=a.source, note=a.note)
    except (OSError, json.JSONDecodeError, NotTheHeadline) as e:
        print(f"headline: error: {e}", file=sys.stderr)
        return 2
    return write(a.headline, headline, {k: headline[k] for k in VALUES if k in headline}, a.dry_run)


def write(path: Path, headline: dict, shown: dict, dry_run: bool) -> int:
    """Print the run's values, and (unless ``dry_run``) write the merged file; main's exit status."""
    print(json.dumps(shown, indent=1))
    if not dry_run:
        path.write_text(json.dumps(headline, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
