"""What a scheduler's /metrics say, as plain numbers: read at scrape time, here or in a replica's process.

One function, so that the server's collector (``omni.serving.metrics``) and a multi-rank replica answering
its router over the replica link (``omni.parallel.replica_link``) report the same figures. Read from a thread
other than the engine's, as the single-process server always has: each figure is one read of a length or a
counter, and the device's memory comes from the allocator's host-side counters (no device call).
"""
from __future__ import annotations

# name: help text; the value is read from the scheduler (see ``scheduler_figures``)
GAUGES = {"omni_queue_depth": "requests waiting for admission",
          "omni_running_requests": "requests in the running batch",
          "omni_kv_pages_used": "KV pool pages held by requests",
          "omni_kv_pages_total": "KV pool pages in the fixed budget",
          "omni_kv_pool_usage_ratio": "used / total KV pages",
          "omni_batch_tokens": "packed tokens per step of the running batch"}
COUNTERS = {"steps": "packed denoising steps run", "step_tokens": "tokens through those steps",
            "admitted": "requests admitted", "finished": "requests completed",
            "failed": "requests failed inside the pipeline", "cancelled": "requests cancelled",
            "rejected": "requests refused with 429"}
STARTUP = ("build", "warm_up", "compile_pass")  # omni_startup_seconds{part}: the scheduler's <part>_s
MEMORY = {"allocated_bytes": "device memory held by live tensors",
          "reserved_bytes": "device memory the caching allocator holds (live tensors and its cache): what other "
                            "processes on the device cannot have",
          "peak_bytes": "most device memory live tensors held since start (the host's peak RSS on a cpu platform)"}


def scheduler_figures(sched, *, memory: bool = True) -> dict:
    """``{"gauges": {metric: value}, "counters": {stats key: value}, "startup": {part: seconds}, "memory":
    [{name: bytes}, ...]}`` of ``sched`` (a ``Scheduler``). ``startup`` has the parts of ``STARTUP`` that ran
    before it served (the build, the warm-up, the warm-up's compile pass). Memory is one dict per rank of its
    pipeline, as each rank's device reports it: one for a single process; a multi-rank replica's driver gives
    every rank's (``DriverPipeline.memory_by_rank``: the followers' as of the last admit or release). Empty with
    ``memory=False`` (the Ray ingress's per-answer figures, which do not export it)."""
    pool = sched.pool
    gauges = (sched.queue_depth, sched.num_running, pool.used_pages, pool.num_pages,
              pool.used_pages / pool.num_pages, sum(t.cost.step_tokens for t in list(sched.running)))
    return {"gauges": {name: float(v) for name, v in zip(GAUGES, gauges)},
            "counters": {key: float(sched.stats[key]) for key in COUNTERS},
            "startup": {part: s for part in STARTUP if (s := getattr(sched, f"{part}_s")) is not None},
            "memory": [{k: float(v) for k, v in rank.items()} for rank in _memory_by_rank(sched.pipeline)]
            if memory else []}


def _memory_by_rank(pipeline) -> list[dict]:
    by_rank = getattr(pipeline, "memory_by_rank", None)  # a multi-rank replica's driver
    return by_rank() if by_rank is not None else [getattr(pipeline, "memory_stats", dict)()]


def startup_seconds(engine) -> dict[str, float]:
    """{part: seconds} of ``STARTUP`` that ``engine`` ran before it served: its local scheduler's, or under a
    multi-rank router the first ready replica's (asked over its link); {} when none answers."""
    found = engine_figures(engine, memory=False)
    return found[0][1]["startup"] if found else {}


def engine_figures(engine, *, memory: bool = True) -> list[tuple[str | None, dict]]:
    """``[(replica label, scheduler_figures)]`` of an engine handle: ``[(None, ...)]`` for one whose scheduler is
    in this process; each ready replica's ``(str(index), ...)`` under a multi-rank router (asked over the replica
    links: ``ReplicaRouter.replica_figures``, which always carries memory); ``[]`` for an engine loop not built."""
    if engine.scheduler is not None:
        return [(None, scheduler_figures(engine.scheduler, memory=memory))]
    per_replica = getattr(engine, "replica_figures", None)  # a router; an engine loop not built yet has neither
    return [(str(i), figures) for i, figures in per_replica()] if per_replica is not None else []
