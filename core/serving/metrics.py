"""Prometheus metrics of one app, on a registry of its own (two apps in one process never clash).

Scheduler state (queue depth, running, KV pages, step counters) is read at
scrape time by a collector; latencies and per-stage seconds are observed as
requests finish.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
STAGE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STAGES = ("queue", "prefill", "denoise", "vae", "encode")


class _EngineCollector:
    """Gauges and counters read from the engine loop at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        sched = self.engine.scheduler
        up = GaugeMetricFamily("omni_engine_up", "1 when the engine loop is ready, 0 while loading or dead")
        up.add_metric([], 1.0 if self.engine.ready else 0.0)
        yield up
        if sched is None:
            return
        pool = sched.pool
        for name, doc, value in (
                ("omni_queue_depth", "requests waiting for admission", sched.queue_depth),
                ("omni_running_requests", "requests in the running batch", sched.num_running),
                ("omni_kv_pages_used", "KV pool pages held by requests", pool.used_pages),
                ("omni_kv_pages_total", "KV pool pages in the fixed budget", pool.num_pages),
                ("omni_kv_pool_usage_ratio", "used / total KV pages", pool.used_pages / pool.num_pages),
                ("omni_batch_tokens", "packed tokens per step of the running batch",
                 sum(t.cost.step_tokens for t in list(sched.running)))):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        yield from _memory_gauges(getattr(sched.pipeline, "memory_stats", dict)())
        for key, doc in (("steps", "packed denoising steps run"), ("step_tokens", "tokens through those steps"),
                         ("admitted", "requests admitted"), ("finished", "requests completed"),
                         ("failed", "requests failed inside the pipeline"), ("cancelled", "requests cancelled"),
                         ("rejected", "requests refused with 429")):
            c = CounterMetricFamily(f"omni_scheduler_{key}", doc)
            c.add_metric([], float(sched.stats[key]))
            yield c


MEMORY_DOCS = {"allocated_bytes": "device memory held by live tensors",
               "reserved_bytes": "device memory the caching allocator holds (live tensors and its cache): what "
                                 "other processes on the device cannot have",
               "peak_bytes": "most device memory live tensors held since start (the host's peak RSS on a cpu "
                             "platform)"}


def _memory_gauges(stats: dict):
    """``omni_device_memory_<name>`` for each byte count the pipeline's device reports (none from a pipeline
    that does not say: a multi-rank replica's devices are in its ranks' processes)."""
    for name, value in stats.items():
        g = GaugeMetricFamily(f"omni_device_memory_{name}", MEMORY_DOCS.get(name, name.replace("_", " ")))
        g.add_metric([], float(value))
        yield g


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
