"""The Ray Serve ingress's Prometheus metrics: answers and losses, and each replica's scheduler, by replica.

Every answer's ``Head`` carries its replica's id and scheduler figures at
that moment; the ingress keeps the latest per replica and exports them as
``omni_replica_*{replica="<id>"}`` (stale by at most one answer, and kept
for a replica that died until the ingress restarts). The replicas' own
``/metrics`` (latencies, stages) are not reachable through the proxy: one
URL reaches one replica at random. Ray Serve's ``ray_serve_*`` metrics, on
each node's Ray metrics port, carry a ``replica`` label too.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .ray_bridge import Head

REPLICA_FIGURES = {
    "up": "1 when the replica's engine was ready at its latest answer",
    "queue_depth": "requests waiting for admission on the replica",
    "running_requests": "requests in the replica's running batch",
    "kv_pool_usage_ratio": "used / total KV pages of the replica",
    "finished": "requests the replica's scheduler completed",
    "steps": "packed denoising steps the replica ran",
    "startup_build_seconds": "what the replica's build took (load or fill, quantize, KV pool)",
    "startup_warm_up_seconds": "what the replica's warm-up took before it served",
    "startup_compile_pass_seconds": "what the compile pass within that warm-up took (serving.compile_first)",
}


class _ReplicaCollector:
    """``omni_replica_<figure>{replica}`` from the latest answer of each replica."""

    def __init__(self):
        self.latest: dict[str, dict[str, float]] = {}
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            latest = dict(self.latest)
        for figure, doc in REPLICA_FIGURES.items():
            family = GaugeMetricFamily(f"omni_replica_{figure}", doc, labels=["replica"])
            for replica, stats in sorted(latest.items()):
                if figure in stats:
                    family.add_metric([replica], stats[figure])
            yield family


class IngressMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.replicas = _ReplicaCollector()
        self.registry.register(self.replicas)
        self.answers = Counter("omni_ray_answers", "answers relayed, by replica and HTTP status",
                               ["replica", "status"], registry=self.registry)
        self.lost = Counter("omni_ray_replica_lost", "forwards whose replica died before answering (then retried)",
                            registry=self.registry)
        self.in_flight = Gauge("omni_ray_in_flight", "requests a replica has taken and not answered yet",
                               ["replica"], registry=self.registry)
        self.failed = Counter("omni_ray_unanswered", "requests no replica answered within ray.retries",
                              registry=self.registry)

    def answered(self, head: Head) -> None:
        self.answers.labels(head.replica, str(head.status)).inc()
        with self.replicas.lock:
            self.replicas.latest[head.replica] = dict(head.stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
