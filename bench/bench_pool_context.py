"""Host time of one forward's attention tables (``PoolContext``): what a decode step builds per token.

A decode step of c answers builds, on the host, each row's KV write slot and
(gathered layout) the slots of all its keys, the fused kernel's ``fresh``
map and the varlen lengths, then copies them to the device. With the steps
launched one ahead of the host (text_steps) this runs while the device
computes the step before; the less it costs, the more answers a step can
carry before the host becomes the limit. Reports microseconds per context
(median of ``--repeat``), for c rows of ``--keys`` keys each, on the CPU
(the tables stay on the host: the copies are not timed).

    python bench/bench_pool_context.py --rows 1,8,32,64 --keys 256,2048
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402

from omni.kv_pool import KVPool, PoolContext, Run  # noqa: E402


def context_us(pool: KVPool, rows: int, keys: int, repeat: int) -> float:
    pages = [pool.allocate(keys + 1) for _ in range(rows)]
    runs = [Run(tuple(p), keys, keys + 1, keys + 1) for p in pages]  # one query a row at its newest position
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        PoolContext(pool, runs, mask="none", paged=False, device="cpu", keys_to=rows * (keys + 1))
        times.append(time.perf_counter() - t0)
    for p in pages:
        pool.release(p)
    return 1e6 * statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--keys", default="256,2048")
    p.add_argument("--page-tokens", type=int, default=256, help="h200_instruct_fp8's kv_cache.page_tokens")
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.set_num_threads(1)
    pool = KVPool(num_layers=1, num_pages=4096, page_size=a.page_tokens, num_kv_heads=1, head_dim=1,
                  dtype=torch.bfloat16, device="cpu", store_gather=lambda *args: None)  # fused: fresh map too
    rows = [{"rows": r, "keys": k, "us_per_context": round(context_us(pool, r, k, a.repeat), 1)}
            for k in map(int, a.keys.split(",")) for r in map(int, a.rows.split(","))]
    for r in rows:
        print(r, flush=True)
    return emit({"commit": git_commit(), "threads": 1, "rows": rows}, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
