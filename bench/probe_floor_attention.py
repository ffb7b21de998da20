"""Why bench_fast's floor times the step's attention slower than the captured step runs it.

In every bench_fast run with a profile since the eighth session (30 raw files in bench/results/), the floor's
attention call, timed alone and eagerly (on ``fast_floor.attention_operands``: random q, k, v over the step's
varlen tables), read 0.05-0.22 ms a layer (1.04-1.23x) above the same FA3 kernel in the captured step's profile
(H200, forty-seventh session: 1.053 against 0.877 ms). That is up to 7 ms of a 32-layer step, enough to move the
engine's ratio to the floor across the issue's 1.15x line (BENCHMARKS.md, "Forty-eighth session"). This probe
separates the causes on one model layer (the released widths, random weights, 1024x1024 with CFG):

- ``floor_call``: the floor's own call;
- ``engine_inputs``: the q, k, v and varlen tables the engine's layer 0 passed in an eager step (recorded);
- ``engine_meta_randn``: the engine's tables with random q, k, v of the same shapes;
- ``floor_meta_engine_inputs``: the engine's q, k, v with the floor's tables.

Each is timed eagerly as the floor times it (``median_seconds``, events back to back), eagerly with a wait after
each call (``cuda_event_median``), and as 8 calls captured in a graph (``chained_seconds``); a profile gives the
kernels' own device time. Eager against graph isolates launch work; inputs against inputs isolates data.
First answer (an H100, forty-eighth session): neither. All four calls took 0.928-0.930 ms in graphs and the
floor's call 0.818 ms eagerly like the engine's inputs (0.817): the floor's slower figure is most likely the
card's clock when bench_fast times it (inferred; no clock was read).

    python3 bench/probe_floor_attention.py --json out.json      # a CUDA device; a dry run on the CPU otherwise
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import chained_seconds, cuda_event_median, median_seconds  # noqa: E402
from bench_fast import parse as bench_fast_args  # noqa: E402
from fast_floor import attention_operands  # noqa: E402
from fast_setup import Setup  # noqa: E402

from omni.platform_manager import select  # noqa: E402


def engine_call(s: Setup):
    """The attention object of layer 0 and the arguments it got in one eager step (cloned)."""
    attn = s.model.model.layers[0].self_attn.attn
    impl, seen = attn["none"], []

    def spy(q, k, v, meta):
        if not seen:
            seen.append((q.clone(), k.clone(), v.clone(), meta))
        return impl(q, k, v, meta)

    attn["none"] = spy
    try:
        s.step(False)
    finally:
        attn["none"] = impl
    return impl, seen[0]


def tables(meta) -> dict:
    return dict(cu_q=list(meta.cu_seqlens_q_host), cu_k=list(meta.cu_seqlens_k_host), max_q=meta.max_seqlen_q,
                max_k=meta.max_seqlen_k, paged=meta.block_table_BP is not None)


def kernel_times(fn, calls: int = 10) -> list:
    """(kernel, device microseconds a call, calls) of the 4 longest kernels ``calls`` calls launch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.device_time_total / e.count, e.count) for e in prof.key_averages() if e.count]
    return sorted(rows, key=lambda r: -r[1])[:4]


def measure(fns: dict, cuda: bool) -> dict:
    out = {name: {"eager_back_to_back_s": median_seconds(fn, 20)} for name, fn in fns.items()}
    if cuda:
        for name, t in chained_seconds(fns, chain=8, rounds=5, burn=6, iters=3).items():
            out[name].update(eager_wait_s=cuda_event_median(fns[name], 30), graph8_s=t,
                             kernels_us=kernel_times(fns[name]))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1024x1024")
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    fast = bench_fast_args(["--layers", "1", "--fast-accum", "--size", a.size, "--prefix", str(a.prefix)] +
                           ([] if cuda else ["--config", "small", "--platform", "cpu"]))
    s = Setup(fast, select(fast.platform), "fp8_row", "cuda" if cuda else "cpu")
    s.prefill()
    impl, (q, k, v, meta) = engine_call(s)
    floor = attention_operands(s, torch.Generator(device=s.device).manual_seed(1))  # the floor's own operands
    floor_meta = floor[3]
    qr, kr, vr = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    fns = {"floor_call": lambda: impl(*floor), "engine_inputs": lambda: impl(q, k, v, meta),
           "engine_meta_randn": lambda: impl(qr, kr, vr, meta),
           "floor_meta_engine_inputs": lambda: impl(q, k, v, floor_meta)}
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "impl": impl.name,
           "engine_tables": tables(meta), "floor_tables": tables(floor_meta)}
    with torch.inference_mode():
        out["calls"] = measure(fns, cuda)
    print(json.dumps(out, indent=1, default=str), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
