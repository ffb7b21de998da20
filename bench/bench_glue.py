"""The glue between a decoder layer's GEMMs at the released shapes: today's torch ops vs kernel libraries vs ours.

One 1024x1024 CFG step packs T = 8194 tokens (2 rows x (1 + 4096)); hidden
4096, 32 query / 8 KV heads of 128, shared-expert width 3072, 64 experts top 8.
For each step of the glue (``omni_glue_impl``) it times, in the same run:

    torch     the reference's ops (the router: the fp32 copy of the rows and an fp32 GEMM)
              (``omni.reference_glue``: what the model ran before fusion);
              the MoE's routing and combine: what the cuda MoE ran before (torch's sort; combine, then two adds)
    liger     liger-kernel's Triton kernel for the same step where it has one (rms_norm,
              fused_add_rms_norm, rope, swiglu), plus our quant_rows where the step also quantizes
    quack     quack-kernels' CuTe-DSL RMSNorm (with the residual add) where it is installed, plus our quant_rows
    ours      ``omni.platforms.cuda.glue.TritonGlue`` (one pass, quantization fused); the router:
              ``omni.platforms.cuda.gemm.SplitFp32Linear`` (bf16 tensor cores, exact split weight)

and the bytes floor (read + write once at the measured copy bandwidth). Times
are medians over ``--rounds`` rounds in which each candidate of a step is
timed in turn (CUDA-event median of ``--iters`` calls), so that no candidate
owns the cool start or the hot end of the power cap's clock drift.

    python bench/bench_glue.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from omni.platform_manager import select
from omni.reference_glue import ReferenceGlue
from omni.platforms.cuda.gemm import SplitFp32Linear
from omni.specs import GemmSpec, GlueSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import cuda_event_median, round_robin  # noqa: E402

T, D, N, K, H, I, E, TOPK = 8194, 4096, 32, 8, 128, 3072, 64, 8
ROUTER = "router logits, fp32 product (x.float() @ wg.T vs the 3 x bf16 split)"


def micros(fn, iters: int) -> float:
    """Microseconds (CUDA-event median)."""
    return cuda_event_median(fn, iters) * 1e6


def liger():
    try:
        from liger_kernel.ops import fused_add_rms_norm, rms_norm, rope, swiglu
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the other candidates still run
        return None, f"{type(e).__name__}: {e}"
    return dict(rms=rms_norm.rms_norm_forward, add_rms=fused_add_rms_norm.fused_add_rms_norm_forward,
                rope=rope.rope_forward, swiglu=swiglu.swiglu_forward), None


def quack():
    try:
        import quack as q
        from quack.rmsnorm import rmsnorm_fwd
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return None, f"{type(e).__name__}: {e}"
    return rmsnorm_fwd, q.__version__


def cases(ours, ref, lig, quant_rows, qk=None):
    """(step -> (bytes moved, {candidate: fn}), step -> () -> {candidate: relative error against fp64})."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    x, d, w, hq = r(T, D), r(T, D), r(D), r(H)
    qkv, h2 = r(T, (N + 2 * K) * H), r(T, 2 * I)
    cos, sin = torch.rand(T, H, device="cuda", generator=g), torch.rand(T, H, device="cuda", generator=g)
    logits = torch.randn(T, E, device="cuda", generator=g)
    wg = torch.randn(E, D, device="cuda", generator=g) / D**0.5
    router = SplitFp32Linear(GemmSpec(in_features=D, out_features=E, dtype=torch.float32))
    wg3 = router.prepare_weight(wg)
    route_fns = {"torch": lambda: F.linear(x.float(), wg), "ours": lambda: router(x, wg3)}

    def route_err():
        exact = F.linear(x.double(), wg.double())
        return {k: float((f().double() - exact).norm() / exact.norm()) for k, f in route_fns.items()}

    c = {
        "rms_norm + fp8 rows (input_layernorm -> qkv)": (2 * T * D * 2 + T * D, {
            "torch": lambda: ref.rms_norm(x, w, True), "ours": lambda: ours.rms_norm(x, w, True)}),
        "add + rms_norm + fp8 rows (post_attention_layernorm)": (3 * T * D * 2 + T * D * 3, {
            "torch": lambda: ref.add_rms_norm(x, d, w, True), "ours": lambda: ours.add_rms_norm(x, d, w, True)}),
        "rope + qk-norm (q and k) + v": (2 * T * (N + 2 * K) * H * 2 + 2 * T * H * 4, {
            "torch": lambda: ref.rope_qk_norm(qkv, cos, sin, hq, hq, (N, K)),
            "ours": lambda: ours.rope_qk_norm(qkv, cos, sin, hq, hq, (N, K))}),
        "shared-expert swiglu + fp8 rows": (T * 2 * I * 2 + T * I, {
            "torch": lambda: ref.swiglu(h2, True), "ours": lambda: ours.swiglu(h2, True)}),
        "router softmax + top-8 + renormalise": (T * E * 4 + T * TOPK * 12, {
            "torch": lambda: ref.route(logits), "ours": lambda: ours.route(logits)}),
        ROUTER: (T * D * 2 + T * E * 4, route_fns),
    }
    c.update(moe_steps(r, g))
    if lig is not None:
        def lig_rms():
            y = lig["rms"](x, w, 1e-5, 0.0, "llama", None)[0]
            return quant_rows(y)

        def lig_add_rms():
            y, h = lig["add_rms"](x, d, w, 1e-5, 0.0, "llama")[:2]
            return h, quant_rows(y)

        def lig_rope():
            q, k, v = ref_split(qkv)
            q, k = lig["rope"](q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])[:2]
            return ref.rms_norm(q, hq, False), ref.rms_norm(k, hq, False), v

        def lig_swiglu():
            x1, x2 = h2.chunk(2, -1)
            return quant_rows(lig["swiglu"](x2.contiguous(), x1.contiguous())[2])

        for name, fn in zip(list(c)[:4], (lig_rms, lig_add_rms, lig_rope, lig_swiglu)):
            c[name][1]["liger (+ our quant_rows)" if "fp8" in name else "liger (+ torch qk-norm)"] = fn
    accuracy = {ROUTER: route_err}
    if qk is not None:  # quack's norms return (out, residual_out, rstd)
        c[list(c)[0]][1]["quack (+ our quant_rows)"] = lambda: quant_rows(qk(x, w, eps=1e-5)[0])

        def qk_err():  # its bf16 output (before our quantization) against the fp64 norm
            exact = F.rms_norm(x.double(), (D,), w.double(), 1e-5)
            return {"quack norm": float((qk(x, w, eps=1e-5)[0].double() - exact).norm() / exact.norm())}
        accuracy[list(c)[0]] = qk_err

        def qk_add_rms():
            y, h, _ = qk(x, w, residual=d, eps=1e-5)
            return h, quant_rows(y)
        c[list(c)[1]][1]["quack (+ our quant_rows)"] = qk_add_rms
    return c, accuracy


def moe_steps(r, g):
    """The MoE's routing and its combine: before (torch's sort + searchsorted + inverse scatter; the combine,
    then the shared expert's and the residual's bf16 adds) vs ours (the two-launch counting sort; the combine
    with both as fp32 addends)."""
    from omni.platforms.cuda.moe import TorchKernels
    from omni.platforms.cuda.moe_triton import TritonKernels

    tk, ok = TorchKernels(), TritonKernels()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(TOPK, dim=-1).indices
    R = T * TOPK
    _, inverse, _ = tk.route_rows(ids, E)
    y, w, h, shared = r(R, D), torch.rand(T, TOPK, device="cuda", generator=g), r(T, D), r(T, D)
    return {
        "MoE routing: sort the 65,552 assignments by expert": (R * 8 + 2 * R * 8 + E * 4, {
            "torch": lambda: tk.route_rows(ids, E), "ours": lambda: ok.route_rows(ids, E)}),
        "MoE combine + shared expert + residual": (R * D * 2 + 3 * T * D * 2, {
            "torch": lambda: h + (shared + ok.combine(y, inverse, w, torch.bfloat16)),
            "ours": lambda: ok.combine(y, inverse, w, torch.bfloat16, (h, shared))}),
    }


def ref_split(qkv):
    from omni.reference_glue import split_qkv

    return split_qkv(qkv, (N, K))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    plat = select("cuda")
    plat.device_services(0)
    spec = GlueSpec(hidden=D, head_dim=H, eps=1e-5, dtype=torch.bfloat16, topk=TOPK)
    ours, ref = plat.glue(spec), ReferenceGlue(spec)
    from omni.platforms.cuda.moe_triton import TritonKernels

    lig, why = liger()
    src = torch.empty(T * D * 4, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (micros(lambda: dst.copy_(src), 20) * 1e-6)  # bytes/s, read + write
    rows = []
    qk, qk_version = quack()
    steps, accuracy = cases(ours, ref, lig, TritonKernels().quant_rows, qk)
    for name, (nbytes, fns) in steps.items():
        row, runs = {"step": name, "floor_us": nbytes / bw * 1e6}, {}
        for k, f in fns.items():
            try:
                f()
                runs[k] = f
            except Exception as e:  # noqa: BLE001 - a candidate that fails is reported, the others still run
                row[k + " error"] = f"{type(e).__name__}: {e}"[:200]
        row.update({k: 1e6 * t for k, t in round_robin(runs, a.rounds, burn=20, iters=a.iters).items()})
        if name in accuracy:
            row.update({f"{k} rel err vs fp64": v for k, v in accuracy[name]().items()})
        rows.append(row)
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    out = {"T": T, "copy_bandwidth_TBps": bw / 1e12, "liger": "0.8.5" if lig else why, "quack": qk_version, "ours": ours.name,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
           "total_us": {k: sum(r.get(k, 0.0) for r in rows) for k in ("torch", "ours", "floor_us")}}
    print(json.dumps(out["total_us"]))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
