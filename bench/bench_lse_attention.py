"""Ring attention's partial kernel: attention that also returns the log-sum-exp, per platform backend.

One ring step at the released head layout (32 query / 8 KV heads of 128,
bf16) for a 1024x1024 CFG step split over two sequence-parallel ranks: this
rank's 4097 queries (half of 2 rows x 4097 tokens) against the fresh chunk in
hand (4097 keys) plus the rows' ~300-token prefixes, with the packed rows'
block-diagonal visibility as a dense mask. Times the platform's kernel for
``AttentionSpec(mask="dense", return_lse=True)`` against the reference
(``omni.reference``: fp32 scores materialized), in the same process.

    python bench/bench_lse_attention.py --json out.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, mean_seconds  # noqa: E402

from omni.platform_manager import select  # noqa: E402
from omni.reference import ReferenceAttention  # noqa: E402
from omni.specs import AttentionSpec, VarlenMeta  # noqa: E402

N, K, H = 32, 8, 128


def ring_step_case(queries: int, chunk: int, prefix: int, device):
    """Queries of two packed rows against both rows' prefixes and a chunk of fresh keys; row-local visibility."""
    row_q = (torch.arange(queries, device=device) >= queries // 2).long()
    row_k = torch.cat([torch.zeros(prefix), torch.ones(prefix), (torch.arange(chunk) >= chunk // 2).float()])
    mask = row_q[:, None] == row_k.to(device).long()[None, :]
    g = torch.Generator(device).manual_seed(0)
    q = torch.randn(queries, N, H, device=device, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(mask.shape[1], K, H, device=device, generator=g, dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (0, queries), (0, mask.shape[1])
    meta = VarlenMeta(cu_seqlens_q_B1=torch.tensor(cu_q, dtype=torch.int32, device=device),
                      cu_seqlens_k_B1=torch.tensor(cu_k, dtype=torch.int32, device=device),
                      max_seqlen_q=queries, max_seqlen_k=mask.shape[1], cu_seqlens_q_host=cu_q,
                      cu_seqlens_k_host=cu_k, mask_TS=mask)
    return q, k, v, meta


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cuda")
    p.add_argument("--queries", type=int, default=4097)
    p.add_argument("--chunk", type=int, default=4097)
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    platform = select(a.platform)
    dev = platform.device_services(0)
    spec = AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16, mask="dense", return_lse=True)
    kernel, reference = platform.attention(spec), ReferenceAttention(spec)
    q, k, v, meta = ring_step_case(a.queries, a.chunk, a.prefix, dev.device)
    t_kernel = mean_seconds(dev, lambda: kernel(q, k, v, meta), a.repeat)
    t_ref = mean_seconds(dev, lambda: reference(q, k, v, meta), a.repeat)
    (o, lse), (o_ref, lse_ref) = kernel(q, k, v, meta), reference(q, k, v, meta)
    out = {"device": platform.info.device_name, "kernel": kernel.name, "queries": a.queries,
           "keys": int(meta.mask_TS.shape[1]), "kernel_ms": 1e3 * t_kernel, "reference_ms": 1e3 * t_ref,
           "speedup": t_ref / t_kernel, "max_abs_err_o": (o.float() - o_ref.float()).abs().max().item(),
           "max_abs_err_lse": (lse - lse_ref).abs().max().item()}
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
