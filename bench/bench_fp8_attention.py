"""FA3's e4m3 forward against its bf16 forward at the image step's attention shapes (issue 17 item 3; a probe).

One CFG image step's attention at the released head layout (32 query / 8 KV heads of 128): two rows of 4097
queries (1024x1024 image tokens plus the timestep token), each against its ~300-token prefix and itself, inputs
as the model feeds them (queries and keys after the QK-norm). Timed, round robin in one process, each captured
``--chain`` times into a CUDA graph (``bench_common.round_robin_seconds``):
- ``bf16``: the platform's attention for ``AttentionSpec(fp8=False)`` (what every recipe runs);
- ``fp8 kernel``: FA3's fp8 forward alone, on inputs quantized beforehand (one scale per tensor);
- ``fp8 path``: the platform's attention for ``AttentionSpec(fp8=True)``, with its per-call quantization.
Each output's relative L2 against the bf16 kernel is printed beside it (docs/quality.md gates it at 0.06).

    python bench/bench_fp8_attention.py --json out.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit, relative, round_robin_seconds  # noqa: E402

from omni.platform_manager import select  # noqa: E402
from omni.specs import AttentionSpec, VarlenMeta  # noqa: E402

N, K, H = 32, 8, 128


def step_case(queries: int, prefix: int, device):
    """q, k, v and the varlen meta of two packed rows, each attending to its prefix and its own queries."""
    lq, lk = [queries] * 2, [queries + prefix] * 2
    g = torch.Generator(device).manual_seed(0)
    norm = lambda x: torch.nn.functional.rms_norm(x, (H,)).bfloat16()  # noqa: E731  the model's QK-norm
    q = norm(torch.randn(sum(lq), N, H, device=device, generator=g) * 3)
    k = norm(torch.randn(sum(lk), K, H, device=device, generator=g) * 3)
    v = torch.randn(sum(lk), K, H, device=device, generator=g).bfloat16()
    cq, ck = (0, lq[0], sum(lq)), (0, lk[0], sum(lk))
    t = lambda c: torch.tensor(c, dtype=torch.int32, device=device)  # noqa: E731
    meta = VarlenMeta(cu_seqlens_q_B1=t(cq), cu_seqlens_k_B1=t(ck), max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                      cu_seqlens_q_host=cq, cu_seqlens_k_host=ck)
    return q, k, v, meta


def prequantized(fp8, q, k, v, meta):
    """The fp8 kernel's call with q, k, v quantized once, outside the timed call."""
    from omni.platforms.cuda.attention import fp8_per_tensor

    (qq, sq), (kq, sk), (vq, sv) = (fp8_per_tensor(x) for x in (q, k, v))
    shape = (meta.num_seqs, K)
    kw = dict(q_descale=sq.expand(shape), k_descale=sk.expand(shape), v_descale=sv.expand(shape))
    return lambda: fp8.run(qq, kq, vq, meta, **kw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=4097)
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chain", type=int, default=8, help="calls captured per graph (0: eager calls)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    commit, platform = git_commit(), select("cuda")
    dev = platform.device_services(0)
    spec = dict(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16)
    bf16, fp8 = platform.attention(AttentionSpec(**spec)), platform.attention(AttentionSpec(**spec, fp8=True))
    if "fp8" not in fp8.name:
        print(f"no fp8 attention here: {fp8.name}", file=sys.stderr)
        return 2
    q, k, v, meta = step_case(a.queries, a.prefix, dev.device)
    fns = {"bf16": lambda: bf16(q, k, v, meta), "fp8 kernel": prequantized(fp8, q, k, v, meta),
           "fp8 path": lambda: fp8(q, k, v, meta)}
    want = fns["bf16"]().double()
    errors = {name: relative(fn().float(), want) for name, fn in fns.items()}
    seconds = round_robin_seconds(fns, a.rounds, a.chain)
    flops = sum(4 * N * H * lq * lk for lq, lk in [(a.queries, a.queries + a.prefix)] * 2)
    rows = {name: {"ms": seconds[name] * 1e3, "tflops": flops / seconds[name] / 1e12,
                   "vs_bf16": seconds["bf16"] / seconds[name], "rel_err_vs_bf16": errors[name]} for name in fns}
    for name, r in rows.items():
        print(f"{name:11s} {r['ms']:.3f} ms  {r['tflops']:.0f} TFLOP/s  {r['vs_bf16']:.2f}x bf16's speed  "
              f"rel err {r['rel_err_vs_bf16']:.4f}", file=sys.stderr)
    out = {"bench": "fp8_attention", "commit": commit, "device": torch.cuda.get_device_name(),
           "kernels": {"bf16": bf16.name, "fp8": fp8.name}, "args": vars(a) | {"json": None}, "rows": rows}
    return emit(out, a.json)


if __name__ == "__main__":
    sys.exit(main())
