"""What DeepGEMM's JIT costs the MoE on DeepGEMM (``kernels.grouped_fp8: deepgemm``): one layer's weight preparation
(which compiles the kernels since the forty-fourth session) and each token count's first call against its second
(a first call that compiles costs seconds), at the released MoE widths
(64 experts, top 8, hidden 4096, inner 3072; random weights), through the platform's MoE as a layer runs it.

Run it with an empty ``DG_JIT_CACHE_DIR`` to see the compile; set ``DG_PRINT_CONFIGS=1`` to see which kernel
configuration each row count gets (a new configuration is a new compile). ``--compile-pass`` first runs one call of
each token count inside the platform's compile scope, as a server's warm-up does (its Triton kernels compile there,
not in the first call).

    DG_JIT_CACHE_DIR=$(mktemp -d) python bench/bench_deepgemm_first_call.py --tokens 1,64,1024,8194 --json out.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402


def seconds(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,64,1024,8194")
    p.add_argument("--compile-pass", action="store_true", help="the warm-up's compile pass before the timed calls")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    from omni import platform_manager
    from omni.specs import MoESpec

    platform = platform_manager.select("cuda")
    platform.device_services(0)
    spec = MoESpec(num_experts=64, topk=8, hidden=4096, inner=3072, dtype=torch.bfloat16, quant="fp8_row",
                   fast_accum=True, grouped_fp8="deepgemm")
    t0 = time.perf_counter()
    moe = platform.moe(spec)
    built = time.perf_counter() - t0
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(64, 6144, 4096, device="cuda", generator=g) / 64).bfloat16()
    w2 = (torch.randn(64, 4096, 3072, device="cuda", generator=g) / 55).bfloat16()
    t0 = time.perf_counter()
    prepared = moe.prepare_weights(w13, w2)  # one layer's load: the block quantization and (now) the compile
    torch.cuda.synchronize()
    prepare_s = time.perf_counter() - t0
    del w13, w2
    tokens = [int(t) for t in a.tokens.split(",")]
    operands = {T: (torch.randn(T, 4096, device="cuda", generator=g).bfloat16(),
                    *torch.rand(T, 64, device="cuda", generator=g).softmax(-1).topk(8, dim=-1)) for T in tokens}
    t0 = time.perf_counter()
    if a.compile_pass:
        with platform.compile_scope():
            for x, w, ids in operands.values():
                moe(x, w, ids, prepared)
    torch.cuda.synchronize()
    compile_pass_s = time.perf_counter() - t0
    rows = []
    for T, (x, w, ids) in operands.items():
        first = seconds(lambda: moe(x, w, ids, prepared))
        second = seconds(lambda: moe(x, w, ids, prepared))
        row = {"tokens": T, "first_call_s": round(first, 4), "second_call_s": round(second, 5)}
        print(row, flush=True)
        rows.append(row)
    return emit({"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "moe": moe.name,
                 "resolve_s": round(built, 3), "prepare_s": round(prepare_s, 3),
                 "compile_pass_s": round(compile_pass_s, 3) if a.compile_pass else None, "rows": rows}, a.json)


if __name__ == "__main__":
    sys.exit(main())
