"""``omni-run bench``: a concurrency sweep over a prompt and size corpus, against a server or in-process.

    omni-run bench --url http://127.0.0.1:8091 --concurrency 1,2,4,8 --requests 16
    omni-run bench --recipe cpu_tiny --steps 2 --concurrency 1,4           # in-process (builds the pipeline)

Each level runs a closed loop: ``c`` clients, each sending its next request
as soon as the previous one is answered, over the corpus (prompts cycled,
sizes mixed, seeds distinct). Reported per level: p50/p90/p99 latency,
images/hour, mean seconds per stage (queue, prefill, denoise, vae, encode)
and, in-process, the peak device memory. Printed as a table, written as JSON.

In-process, the engine is built as ``omni-run serve`` builds it, warm-up
included (``serving.warmup_steps``; the compile pass first where
``serving.compile_first``): ``time_to_ready_s`` is what a server takes to
report ready, split in the JSON's ``ready`` into build and warm-up. Against a
URL, ``ready`` is the server's own split from its /metrics
(``omni_startup_seconds``) and ``time_to_ready_s`` is left out (null).
``--full-size-layers N`` builds the released shapes with random values, layer
by layer as a checkpoint loads (one process: parallel layouts are
``bench/bench_parallel.py``'s).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .scheduler_figures import STARTUP, startup_seconds

PROMPTS = (
    "a red fox standing in fresh snow, soft morning light",
    "an isometric illustration of a tiny city block at night with neon signs",
    "a bowl of ramen on a wooden table, steam rising, shallow depth of field",
    "a lighthouse on a rocky cliff during a storm, dramatic waves",
    "a watercolor map of an imaginary archipelago with compass rose",
    "a macro photograph of a hummingbird feeding from a red flower",
    "a friendly robot reading a book in an old library",
    "a calm mountain lake at dawn with mist over the water",
    "a vintage travel poster for a city on Mars",
    "a still life of lemons and a glass jug, oil painting",
    "a snowy street in Kyoto at dusk with lanterns",
    "a blueprint-style drawing of a steam locomotive",
)
SIZES = "1024x1024,1280x768,768x1280,1152x896,896x1152"
STAGES = ("queue", "prefill", "denoise", "vae", "encode")


@dataclass
class Sample:
    ok: bool
    latency_s: float
    status: str = "ok"
    stages: dict[str, float] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def corpus(args) -> list[dict]:
    """The request bodies of one level: prompts cycled, sizes mixed, distinct seeds."""
    prompts = PROMPTS
    if args.prompts:
        prompts = tuple(p for p in Path(args.prompts).read_text().splitlines() if p.strip())
    sizes = args.sizes.split(",")
    bodies = []
    for i in range(args.requests):
        b = {"prompt": prompts[i % len(prompts)], "size": sizes[i % len(sizes)], "seed": args.seed + i}
        if args.steps is not None:
            b["num_inference_steps"] = args.steps
        if args.guidance is not None:
            b["guidance_scale"] = args.guidance
        bodies.append(b)
    return bodies


# ------------------------------------------------------------------ targets


class HttpTarget:
    """A running server's /v1/images/generations."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float):
        import httpx

        self.url, self.name = url.rstrip("/"), url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()
        self._client = lambda: httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def check(self) -> None:
        import httpx

        from .cli_jobs import UsageError

        try:
            with self._client() as client:
                r = client.get("/health")
        except httpx.TransportError as e:  # nothing there: the flag is wrong (or the server is not up yet)
            raise UsageError(f"--url {self.name}: cannot reach {self.url}/health ({type(e).__name__}: {e})") from None
        if r.status_code != 200:
            raise SystemExit(f"{self.url}/health answered {r.status_code}: {r.text[:200]}")
        self.ready = self.startup()

    def send(self, body: dict) -> Sample:
        client = getattr(self._local, "client", None) or self._client()
        self._local.client = client
        t0 = time.perf_counter()
        try:
            r = client.post("/v1/images/generations", json={**body, "return_timings": True})
        except Exception as e:  # a refused or dropped connection is a failed sample, not a crash
            return Sample(False, time.perf_counter() - t0, type(e).__name__)
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            return Sample(False, dt, str(r.status_code))
        return Sample(True, dt, stages=r.json()["data"][0].get("timings", {}))

    def _metrics(self) -> str:
        """The server's /metrics text now; "" where it cannot be read (a figure missing from the report, not a
        failed benchmark)."""
        try:
            with self._client() as client:
                r = client.get("/metrics")
        except Exception:  # noqa: BLE001
            return ""
        return r.text if r.status_code == 200 else ""

    def reserved_memory(self) -> int | None:
        """The server's ``omni_device_memory_reserved_bytes`` from its /metrics now, summed over its samples: one
        for a single process, one per replica and rank for a multi-rank server (each rank's own device, the
        followers' as of their replica's last admit or release), so the deployment's whole. None where /metrics
        cannot be read or has no such figure (a cpu server)."""
        found = re.findall(r"^omni_device_memory_reserved_bytes(?:\{[^}]*\})? ([0-9.e+]+)$", self._metrics(),
                           flags=re.M)
        return int(sum(float(v) for v in found)) if found else None

    def startup(self) -> dict:
        """What the server took before it served, by part, from its /metrics' ``omni_startup_seconds`` (a
        multi-rank server's first replica); None for a part it does not report."""
        found = re.findall(r'^omni_startup_seconds\{part="(\w+)"(?:,replica="0")?\} ([0-9.e+-]+)$', self._metrics(),
                           flags=re.M)
        return ready_split({part: float(seconds) for part, seconds in found})

    def peak_memory(self) -> None:  # the server's peak counts from its start, not from this level's: not reported
        return None

    def reset_peak_memory(self) -> None:
        pass

    def close(self) -> None:
        pass


class InProcessTarget:
    """The deployment built here, behind the same engine handle the server uses."""

    def __init__(self, args):
        from omni.deployment import prepare
        from omni.recipe import load_recipe, parse_overrides

        recipe = load_recipe(args.recipe)
        overrides = parse_overrides(args.set)
        if args.model:
            overrides["model.path"] = args.model
        if args.max_running or "serving.max_running" not in overrides:
            overrides["serving.max_running"] = args.max_running or max(recipe.serving.max_running, max(args.levels))
        overrides.setdefault("serving.max_queue", max(args.levels))  # a closed loop never has more waiting
        self.deployment = d = prepare(recipe, platform=args.platform, overrides=overrides,
                                      random_weights=bool(args.full_size_layers))
        self.name = f"in-process {d.recipe.name} on {d.recipe.platform}"
        import torch

        info = d.platform().info
        self.host = {"device": info.device_name, "device_count": info.device_count, "torch": torch.__version__}
        self.services = d.platform().device_services(0) if d.world_size == 1 else None
        t0 = time.perf_counter()
        # as ``omni-run serve`` builds it: load (or fill), quantize, KV pool, then the server's warm-up
        self.engine = d.open_engine(warm_up=args.server_warm_up, random_layers=args.full_size_layers).start()
        self.engine.wait_ready()
        self.time_to_ready_s = round(time.perf_counter() - t0, 2)
        self.ready = ready_split(startup_seconds(self.engine))  # now: a launched layout's replicas stop with it
        self.defaults, self.png_level = d.recipe.defaults, d.recipe.serving.png_compress_level
        if self.engine.ready:
            print(f"ready in {self.time_to_ready_s:.2f} s: build {_fmt(self.ready['build_s'])} s, server warm-up "
                  f"{_fmt(self.ready['warm_up_s'])} s (compile pass {_fmt(self.ready['compile_pass_s'])} s)")

    def check(self) -> None:
        if not self.engine.ready:
            raise SystemExit(f"the engine did not start: {self.engine.unavailable_reason()}")

    def send(self, body: dict) -> Sample:
        from omni.recipe import parse_size
        from omni.request import ImageRequest
        from omni.serving.encode import encode_image

        w, h = parse_size(body["size"])
        d = self.defaults
        req = ImageRequest(prompt=body["prompt"], height=h, width=w, seed=body["seed"],
                           steps=body.get("num_inference_steps", d.steps),
                           guidance=body.get("guidance_scale", d.guidance), shift=d.shift, template=d.template,
                           system_prompt=d.system_prompt)
        t0 = time.perf_counter()
        try:
            [ticket] = self.engine.submit_many([req])
            result = ticket.result()
            t1 = time.perf_counter()
            encode_image(result.image_HW3, png_level=self.png_level)
            result.times.encode = time.perf_counter() - t1
        except Exception as e:
            return Sample(False, time.perf_counter() - t0, type(e).__name__)
        return Sample(True, time.perf_counter() - t0, stages=result.times.as_dict())

    def peak_memory(self) -> int | None:
        return None if self.services is None else self.services.max_memory_allocated()

    def reserved_memory(self) -> int | None:
        """What the caching allocator holds now (allocated plus its cache): what other processes on the card
        cannot have. None on the CPU and for a server."""
        return None if self.services is None else self.services.memory_stats().get("reserved_bytes")

    def reset_peak_memory(self) -> None:
        if self.services is not None:
            self.services.reset_peak_memory()

    def close(self) -> None:
        self.engine.stop()


# ------------------------------------------------------------------ the sweep


def run_level(target, bodies: list[dict], concurrency: int) -> dict:
    """Closed loop: ``concurrency`` clients drain ``bodies`` one request at a time each."""
    pending = iter(bodies)
    lock = threading.Lock()
    samples: list[Sample] = []

    def client():
        while True:
            with lock:
                body = next(pending, None)
            if body is None:
                return
            s = target.send(body)
            with lock:
                samples.append(s)

    target.reset_peak_memory()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    return summarize(samples, concurrency, wall, target.peak_memory()) | {
        "device_memory_reserved_bytes": target.reserved_memory()}


def summarize(samples: list[Sample], concurrency: int, wall: float, peak: int | None) -> dict:
    ok = [s for s in samples if s.ok]
    lat = [s.latency_s for s in ok]
    errors: dict[str, int] = {}
    for s in samples:
        if not s.ok:
            errors[s.status] = errors.get(s.status, 0) + 1
    stages = {k: round(sum(s.stages.get(k, 0.0) for s in ok) / len(ok), 4) if ok else None for k in STAGES}
    return {"concurrency": concurrency, "requests": len(samples), "ok": len(ok), "errors": errors,
            "wall_s": round(wall, 3), "images_per_hour": round(len(ok) / wall * 3600, 1) if wall else None,
            "latency_s": {k: _round(percentile(lat, q)) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))}
            | {"mean": _round(sum(lat) / len(lat)) if lat else None},
            "stage_mean_s": stages, "peak_device_memory_bytes": peak}


def ready_split(seconds_by_part: dict[str, float]) -> dict:
    """The JSON's ``ready``: ``{build_s, warm_up_s, compile_pass_s}`` from an engine's start-up seconds by part
    (``omni_startup_seconds``); None for a part that did not run or was not reported."""
    return {f"{part}_s": _round(seconds_by_part.get(part)) for part in STARTUP}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def table(levels: list[dict]) -> str:
    head = ("conc", "ok/req", "p50 s", "p90 s", "p99 s", "img/h", "queue", "prefill", "denoise", "vae", "encode",
            "peak GiB", "reserved GiB")
    rows = [head]
    for lv in levels:
        lat, st = lv["latency_s"], lv["stage_mean_s"]
        peak, reserved = lv["peak_device_memory_bytes"], lv.get("device_memory_reserved_bytes")
        rows.append((str(lv["concurrency"]), f"{lv['ok']}/{lv['requests']}",
                     *(_fmt(lat[k]) for k in ("p50", "p90", "p99")), _fmt(lv["images_per_hour"], 1),
                     *(_fmt(st[k], 3) for k in STAGES), _gib(peak), _gib(reserved)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _fmt(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omni-run bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    where = p.add_argument_group("target (a server URL, else in-process)")
    where.add_argument("--url", help="base URL of a running omni-run server, e.g. http://127.0.0.1:8091")
    where.add_argument("--api-key", help="bearer key for --url")
    where.add_argument("--recipe", default="cpu_tiny", help="in-process: recipe (default cpu_tiny)")
    where.add_argument("--platform", default=None, help="in-process: platform (default: the recipe's)")
    where.add_argument("--model", default=None, help="in-process: checkpoint directory")
    where.add_argument("--full-size-layers", type=int, default=0, metavar="N",
                       help="in-process: released shapes, N layers, random weights (source checkout: bench/)")
    where.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="in-process: recipe override, e.g. --set serving.max_batch_tokens=65536 (repeatable)")
    where.add_argument("--max-running", type=int, default=0, help="in-process: serving.max_running "
                                                                   "(default: max of recipe and concurrency)")
    where.add_argument("--no-server-warm-up", dest="server_warm_up", action="store_false",
                       help="in-process: skip the server's warm-up (serving.warmup_steps requests, after the "
                            "compile pass where serving.compile_first): time_to_ready_s then counts the build "
                            "alone and the first --warmup request pays the compiles")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", default="1,2,4", help="comma list of concurrent clients (default 1,2,4)")
    load.add_argument("--requests", type=int, default=8, help="requests per level (default 8)")
    load.add_argument("--sizes", default=SIZES, help=f"WxH list, mixed across requests (default {SIZES})")
    load.add_argument("--prompts", help="file with one prompt per line (default: a built-in corpus)")
    load.add_argument("--steps", type=int, default=None, help="num_inference_steps (default: the server's)")
    load.add_argument("--guidance", type=float, default=None, help="guidance_scale (default: the server's)")
    load.add_argument("--seed", type=int, default=0, help="seed of the first request (then +1 each)")
    load.add_argument("--warmup", type=int, default=1, help="unmeasured requests per size first, then one "
                      "unmeasured round at each concurrency level (0: none; default 1)")
    load.add_argument("--timeout-s", type=float, default=1800.0, help="HTTP timeout per request")
    p.add_argument("--json", default="bench.json", help="where to write the results (default bench.json)")
    return p


def bench_main(argv_or_args=None) -> int:
    """Entry point of ``omni-run bench``: ``argv`` list (or a Namespace carrying ``bench_args``)."""
    argv = getattr(argv_or_args, "bench_args", argv_or_args)
    args = parser().parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    target = HttpTarget(args.url, args.api_key, args.timeout_s) if args.url else InProcessTarget(args)
    try:
        target.check()
        sizes = args.sizes.split(",")
        for i in range(args.warmup * len(sizes)):
            target.send({**corpus(args)[0], "size": sizes[i % len(sizes)]})
        levels = []
        for c in args.levels:
            if args.warmup:  # one unmeasured round at this concurrency: its batch shapes are captured here
                run_level(target, corpus(args)[:c], c)
            levels.append(run_level(target, corpus(args), c))
            print(f"concurrency {c}: {levels[-1]['ok']}/{levels[-1]['requests']} ok, "
                  f"p50 {_fmt(levels[-1]['latency_s']['p50'])} s", flush=True)
    finally:
        target.close()
    print(table(levels))
    out = {"benchmark": "omni-run bench", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "target": target.name, "args": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
           "time_to_ready_s": getattr(target, "time_to_ready_s", None), "levels": levels}
    out["ready"] = target.ready
    if isinstance(target, InProcessTarget):
        out["host"] = target.host
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json}")
    return 0 if all(lv["ok"] == lv["requests"] for lv in levels) else 1
