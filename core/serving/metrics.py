"""Prometheus metrics of one app, on a registry of its own (two apps in one process never clash).

Scheduler state (queue depth, running, KV pages, step counters, the device's
memory) is read at scrape time by a collector, per replica under a multi-rank
router; latencies and per-stage seconds are observed as requests finish.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from omni.scheduler_figures import COUNTERS, GAUGES, MEMORY, STARTUP, engine_figures

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STAGES = ("queue", "prefill", "denoise", "vae", "encode")


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time: its scheduler's, or under a multi-rank router
    each ready replica's, labelled ``replica`` (their schedulers live in the replicas' processes)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        up = GaugeMetricFamily("omni_engine_up", "1 when the engine loop is ready, 0 while loading or dead")
        up.add_metric([], 1.0 if self.engine.ready else 0.0)
        yield up
        labels, sources = _sources(self.engine)
        if sources:
            yield from gauge_families(sources, labels)
            yield from memory_families(sources, labels)
            yield from counter_families(sources, labels)
            yield startup_family(sources, labels)


def _sources(engine) -> tuple[list[str], list[tuple[list[str], dict]]]:
    """(label names, [(label values, ``scheduler_figures``)]): one unlabelled source for a local scheduler."""
    found = engine_figures(engine)
    if found and found[0][0] is None:
        return [], [([], found[0][1])]
    return ["replica"], [([replica], figures) for replica, figures in found]


def gauge_families(sources: list, labels: list[str]):
    for name, doc in GAUGES.items():
        g = GaugeMetricFamily(name, doc, labels=labels)
        for values, figures in sources:
            g.add_metric(values, figures["gauges"][name])
        yield g


def memory_families(sources: list, labels: list[str]):
    """``omni_device_memory_<name>`` for each byte count a source's devices report; labelled ``rank`` too when a
    source reports more than one rank (a multi-rank replica: each rank's device)."""
    per_rank = any(len(figures["memory"]) > 1 for _, figures in sources)
    rows = [(values + [str(rank)] if per_rank else values, stats)
            for values, figures in sources for rank, stats in enumerate(figures["memory"])]
    for name in sorted({n for _, stats in rows for n in stats}):
        g = GaugeMetricFamily(f"omni_device_memory_{name}", MEMORY.get(name, name.replace("_", " ")),
                              labels=labels + ["rank"] if per_rank else labels)
        for values, stats in rows:
            if name in stats:
                g.add_metric(values, stats[name])
        yield g


def startup_family(sources: list, labels: list[str]) -> GaugeMetricFamily:
    """``omni_startup_seconds{part}``: what the engine took to be ready, by part (``STARTUP``): the pipeline's
    build (load or fill, quantize, KV pool), the server's warm-up, and the warm-up's compile pass within it."""
    g = GaugeMetricFamily("omni_startup_seconds", "seconds the engine took before it served, by part (build, "
                          "warm_up; compile_pass is part of warm_up)", labels=labels + ["part"])
    for values, figures in sources:
        for part in STARTUP:
            if part in figures["startup"]:
                g.add_metric(values + [part], figures["startup"][part])
    return g


def counter_families(sources: list, labels: list[str]):
    for key, doc in COUNTERS.items():
        c = CounterMetricFamily(f"omni_scheduler_{key}", doc, labels=labels)
        for values, figures in sources:
            c.add_metric(values, figures["counters"][key])
        yield c


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.requests = Counter("omni_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("omni_request_latency_seconds", "end-to-end seconds of successful requests",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.stage = Histogram("omni_stage_seconds", "seconds per image in each stage", ["stage"],
                               buckets=STAGE_BUCKETS, registry=self.registry)
        self.step = Histogram("omni_engine_step_seconds", "wall seconds of one engine iteration",
                              buckets=STAGE_BUCKETS, registry=self.registry)
        self.images = Counter("omni_images_generated", "images returned", registry=self.registry)
        self.text_tokens = Counter("omni_text_tokens_generated", "tokens of the text answers returned",
                                   registry=self.registry)

    def observe_stages(self, times: dict[str, float]) -> None:
        for stage in STAGES:
            self.stage.labels(stage).observe(times.get(stage, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
