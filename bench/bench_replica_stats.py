"""What a multi-rank replica's scheduler figures cost to read: the replica link's ``stats`` round trip.

A multi-rank replica's scheduler runs in its first rank's process. ``/metrics`` of a multi-rank server and every
answer of a multi-rank Ray Serve replica (``ray_bridge.scheduler_stats``) read its figures over the replica link
(``ReplicaRouter.replica_figures``). This launches a real replica (``start_replicas``: ``--tp`` ranks, gloo on the
cpu platform) and times that read, idle and while one long request runs on the replica.

    python bench/bench_replica_stats.py --recipe cpu_tiny --tp 2 --n 200 --json out.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402


def read_times_ms(router, n: int) -> dict:
    """Median, p90 and max milliseconds of ``n`` reads of every replica's figures."""
    ms = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert router.replica_figures(), "the replica did not answer"
        ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * n)], "max_ms": ms[-1], "reads": n}


def measure(args) -> dict:
    from omni.deployment import prepare
    from omni.parallel.dp import start_replicas
    from omni.request import ImageRequest

    deployment = prepare(args.recipe, platform=args.platform,
                         overrides={"parallel.tp": args.tp, "device.count": args.tp})
    router = start_replicas(deployment, connect_timeout_s=180)
    try:
        router.start()
        assert router.wait_ready(180), router.unavailable_reason()
        idle = read_times_ms(router, args.n)
        busy = router.submit_many([ImageRequest(prompt="snow", steps=args.busy_steps, seed=1, request_id="busy")])[0]
        time.sleep(1.0)  # the request is admitted and stepping
        running = read_times_ms(router, args.n)
        router.cancel(busy)
    finally:
        router.stop(60)
    return {"recipe": args.recipe, "platform": args.platform, "tp": args.tp, "commit": git_commit(),
            "idle": idle, "while_a_request_runs": running}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="cpu_tiny")
    p.add_argument("--platform", default="cpu")
    p.add_argument("--tp", type=int, default=2, help="ranks of the one replica")
    p.add_argument("--n", type=int, default=200, help="reads per condition")
    p.add_argument("--busy-steps", type=int, default=400, help="steps of the request that runs during the second set")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    out = measure(args)
    for name in ("idle", "while_a_request_runs"):
        r = out[name]
        print(f"{name}: median {r['median_ms']:.2f} ms, p90 {r['p90_ms']:.2f} ms, max {r['max_ms']:.2f} ms "
              f"over {r['reads']} reads")
    return emit(out, args.json)


if __name__ == "__main__":
    sys.exit(main())
