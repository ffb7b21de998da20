"""The image step's attention call, every candidate kernel (issue 17 item 3, and FA3's GQA packing).

One CFG image step's attention at the released head layout (32 query / 8 KV heads of 128): two rows of
``--queries`` queries (1024x1024 image tokens plus the timestep token), each against its ``--prefix``-token prefix
and itself, inputs as the model feeds them (q and k after the QK-norm). Timed round robin in one process, each
captured ``--chain`` times into a CUDA graph as a captured step runs it (``bench_common.round_robin_seconds``):
- ``bf16``: the platform's attention for ``AttentionSpec()`` (what every recipe runs; FA3 unpacked here, by
  ``fa3_pack_gqa``), and ``bf16 packed``: the same with the query heads packed (FA3's choice for every varlen call);
- ``bf16 batched``: FA3's fixed-length call on the same rows (both rows are equally long here; the engine's are not);
- ``fp8 kernel``: FA3's e4m3 forward alone, on q, k, v quantized beforehand (one scale per tensor);
- ``fp8 path``: the platform's attention for ``AttentionSpec(fp8=True)`` (``attention.fp8``), its quantization
  (``fp8_tensor_triton``) included, and ``fp8 torch quant``: the same with torch's quantization ops, as before;
- ``sage int8 qk``: ``sageattention``'s ``sageattn_varlen`` where it imports (Triton: int8 QK per block with k
  smoothed, fp16 PV). It reads ``cu_seqlens`` on the host, so no graph can hold it: it is timed eagerly, beside an
  eager ``bf16``. It subtracts k's mean from ``k`` in place, so it gets a copy (the copy is timed too).
Each output's relative L2 against the bf16 kernel is printed beside it (docs/quality.md gates fp8 at 0.06).
``--sweep`` times ``bf16`` against ``bf16 packed`` at other query lengths, to check the packing rule.

    python bench/bench_attention_candidates.py --sweep 300,1024,2048 --json out.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit, relative, round_robin, round_robin_seconds  # noqa: E402

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


def own_fa3(spec: AttentionSpec, pack: bool | None = None):
    """FA3's attention as the platform builds it, as a new object (the platform's is cached per spec and shared):
    ``pack`` forces the query heads' packing either way; its fp8 quantization is torch's ops (``fp8_per_tensor``)."""
    from omni.platforms.cuda.attention import Fa3Attention
    from omni.platforms.cuda.capabilities import detect_caps, load_fa3

    impl = Fa3Attention(spec, load_fa3(detect_caps(0).fa3_module))
    if pack is not None:
        impl.pack_gqa = lambda _rows: pack
    return impl


def prequantized(fp8, q, k, v, meta):
    """The fp8 kernel's call with q, k, v quantized once, outside the timed call."""
    from omni.platforms.cuda.attention import fp8_per_tensor

    (qq, sq), (kq, sk), (vq, sv) = (fp8_per_tensor(x) for x in (q, k, v))
    shape = (meta.num_seqs, K)
    kw = dict(q_descale=sq.expand(shape), k_descale=sk.expand(shape), v_descale=sv.expand(shape))
    return lambda: fp8.run(qq, kq, vq, meta, **kw)


def batched(bf16, q, k, v, meta):
    """FA3's fixed-length call (``flash_attn_func``) on the equal rows as [2, rows, heads, 128]."""
    rows = lambda x, cu: x.view(2, cu[1], *x.shape[1:])  # noqa: E731
    first = lambda o: o[0] if isinstance(o, tuple) else o  # noqa: E731
    qb, kb, vb = rows(q, meta.cu_seqlens_q_host), rows(k, meta.cu_seqlens_k_host), rows(v, meta.cu_seqlens_k_host)
    return lambda: first(bf16.mod.flash_attn_func(qb, kb, vb, softmax_scale=bf16.scale)).view(q.shape)


def sage(q, k, v, meta):
    try:
        from sageattention.core import sageattn_varlen
    except ImportError as e:
        print(f"no sageattention here: {e}", file=sys.stderr)
        return None
    return lambda: sageattn_varlen(q, k.clone(), v, meta.cu_seqlens_q_B1, meta.cu_seqlens_k_B1, meta.max_seqlen_q,
                                   meta.max_seqlen_k)


def rows_of(fns: dict, seconds: dict, want, flops: float, base: str = "bf16") -> dict:
    rows = {}
    for name, fn in fns.items():
        s = seconds[name]
        rows[name] = {"ms": s * 1e3, "tflops": flops / s / 1e12, "vs_bf16": seconds[base] / s,
                      "rel_err_vs_bf16": relative(fn().float(), want)}
        print(f"{name:14s} {s * 1e3:.3f} ms  {flops / s / 1e12:.0f} TFLOP/s  {seconds[base] / s:.2f}x bf16's speed  "
              f"rel err {rows[name]['rel_err_vs_bf16']:.4f}", file=sys.stderr)
    return rows


def step_rows(platform, a, device) -> dict:
    spec = dict(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16)
    bf16, fp8 = platform.attention(AttentionSpec(**spec)), platform.attention(AttentionSpec(**spec, fp8=True))
    q, k, v, meta = step_case(a.queries, a.prefix, device)
    fns = {"bf16": lambda: bf16(q, k, v, meta)}
    if "fa3" in bf16.name:
        bf16_packed = own_fa3(AttentionSpec(**spec), pack=True)
        fns |= {"bf16 packed": lambda: bf16_packed(q, k, v, meta), "bf16 batched": batched(bf16, q, k, v, meta)}
    if "fp8" in fp8.name:
        torch_quant = own_fa3(AttentionSpec(**spec, fp8=True))
        fns |= {"fp8 kernel": prequantized(fp8, q, k, v, meta), "fp8 path": lambda: fp8(q, k, v, meta),
                "fp8 torch quant": lambda: torch_quant(q, k, v, meta)}
    want = fns["bf16"]().double()
    flops = 2 * 4 * N * H * a.queries * (a.queries + a.prefix)
    out = {"kernels": {"bf16": bf16.name, "fp8": fp8.name},
           "rows": rows_of(fns, round_robin_seconds(fns, a.rounds, a.chain), want, flops)}
    eager = sage(q, k, v, meta)
    if eager is not None:  # not capturable: timed eagerly beside the eager bf16 call
        pair = {"bf16": fns["bf16"], "sage int8 qk": eager}
        out["eager_rows"] = rows_of(pair, round_robin(pair, a.rounds), want, flops)
    return out


def sweep_rows(platform, a, device) -> dict:
    spec = AttentionSpec(num_heads=N, num_kv_heads=K, head_dim=H, dtype=torch.bfloat16)
    rule, forced, out = platform.attention(spec), own_fa3(spec, pack=True), {}
    for queries in a.sweep:
        q, k, v, meta = step_case(queries, a.prefix, device)
        fns = {"bf16": lambda: rule(q, k, v, meta), "bf16 packed": lambda: forced(q, k, v, meta)}
        flops = 2 * 4 * N * H * queries * (queries + a.prefix)
        print(f"queries {queries} (rule packs: {rule.pack_gqa(queries)})", file=sys.stderr)
        rows = rows_of(fns, round_robin_seconds(fns, a.rounds, a.chain), fns["bf16"]().double(), flops)
        out[str(queries)] = {"rule_packs": rule.pack_gqa(queries), "rows": rows}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--queries", type=int, default=4097)
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chain", type=int, default=8, help="calls captured per graph (0: eager calls)")
    p.add_argument("--sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="query lengths at which to time FA3 packed against the packing rule (comma-separated)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    platform = select("cuda")
    device = platform.device_services(0).device
    out = {"bench": "attention_candidates", "commit": git_commit(), "device": torch.cuda.get_device_name(),
           "args": vars(a) | {"json": None}} | step_rows(platform, a, device)
    if a.sweep and "fa3" in out["kernels"]["bf16"]:
        out["sweep"] = sweep_rows(platform, a, device)
    return emit(out, a.json)


if __name__ == "__main__":
    sys.exit(main())
