"""bench_fast part (c): the kernel floor. The step's GEMMs (exact shapes, pre-quantized inputs, balanced
experts) and its attention kernel, each timed alone and (fp8) all captured into one graph replayed back to back:
time no implementation of the step can beat by much."""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import captured, median_seconds  # noqa: E402
from fast_setup import RELEASED_LAYERS, Setup  # noqa: E402

from omni import quant as Q  # noqa: E402
from omni.kv_pool import _meta  # noqa: E402
from omni.specs import GroupedGemmSpec, MoESpec  # noqa: E402


def step_flops(cfg, T: int, keys_per_query: list[int]) -> dict:
    """FLOPs of one layer's GEMMs and attention for T packed tokens (2 per multiply-add)."""
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inner, k, E = cfg.moe_intermediate_size[0], cfg.moe_topk[0], cfg.num_experts
    shared = inner * cfg.num_shared_expert[0]
    shared_expert = 2 * T * (D * 2 * shared + shared * D)
    dense = 2 * T * (D * (N + 2 * K) * H + N * H * D + D * E) + shared_expert
    routed = 2 * T * k * (D * 2 * inner + inner * D)
    attn = sum(4 * N * H * lk for lk in keys_per_query)
    return {"dense": dense, "routed": routed, "attention": attn, "total": dense + routed + attn,
            "shared_expert": shared_expert}  # part of dense


def floor(a, s: Setup, out, platform):
    """Each kernel of the step timed alone, in bf16 and fp8 (the fp8 ones also back to back), and their rates."""
    g = torch.Generator(device=s.device).manual_seed(2)
    offs = _balanced_offsets(s)
    res = {}
    for prec in ("bf16", "fp8"):
        times, kept = {}, {}
        for name, fn in _kernels(a, s, prec, platform, offs, g, res):
            times[name] = median_seconds(fn, 20)
            if prec == "fp8":
                kept[name] = fn  # with its operands: replayed back to back below
            fn = None  # a bf16 kernel's operands are freed before the next kernel's are drawn
        total = sum(times.values())
        res[prec] = {"per_layer_s": total, "kernels_s": times, "step_32_layers_s": total * RELEASED_LAYERS,
                     "image_s": total * RELEASED_LAYERS * a.steps}
        print(f"[floor {prec}] per layer {total*1e3:.2f} ms: " +
              ", ".join(f"{n} {t*1e3:.2f}" for n, t in times.items()), flush=True)
        if kept and a.floor_rounds > 1:
            res[prec]["alone_rounds"] = alone_rounds(kept, times, a.floor_rounds)
        if kept and torch.cuda.is_available():
            res[prec]["captured_alone"] = captured_alone(kept)
            res[prec]["sustained"] = sustained_floor(kept, a.timed)
            kept.clear()
    _rates(res, s)
    out["floor"] = res


def _balanced_offsets(s: Setup) -> torch.Tensor:
    """Group ends of the routed rows spread evenly over the experts (the floor's best case)."""
    cfg = s.cfg
    R, E = s.rows * s.n_block * cfg.moe_topk[0], cfg.num_experts
    sizes = [R // E + (1 if e < R % E else 0) for e in range(E)]
    return torch.tensor(sizes, device=s.device).cumsum(0).to(torch.int32)


def _kernels(a, s: Setup, prec: str, platform, offs, g, res: dict):
    """(name, call) for each kernel of one layer in ``prec``, made one at a time (each with its own operands, so
    the bf16 operands of one shape are freed before the next shape's are drawn)."""
    yield from _dense_kernels(a, s, prec, g)
    yield from _expert_kernels(a, s, prec, platform, offs, g, res)
    yield "attention", _attention_kernel(s, g)


def _dense_kernels(a, s: Setup, prec: str, g):
    cfg, dev, T = s.cfg, s.device, s.rows * s.n_block
    D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inner, E = cfg.moe_intermediate_size[0], cfg.num_experts
    shapes = {"qkv": ((N + 2 * K) * H, D), "o_proj": (D, N * H), "shared_gate_up": (2 * inner, D),
              "shared_down": (D, inner), "router": (E, D)}
    for name, (o, i) in shapes.items():
        x = torch.randn(T, i, device=dev, generator=g, dtype=torch.bfloat16)
        w = torch.randn(o, i, device=dev, generator=g, dtype=torch.bfloat16)
        if prec == "bf16" or name == "router":
            yield name, lambda x=x, w=w: x @ w.t()
        else:
            xq, xs = Q.quantize_fp8(x, True)
            wq, ws = Q.quantize_fp8(w, True)
            yield name, lambda xq=xq, xs=xs, wq=wq, ws=ws: torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16, use_fast_accum=a.fast_accum)
        x = w = None  # before the next shape's operands are drawn


def _expert_kernels(a, s: Setup, prec: str, platform, offs, g, res: dict):
    """The routed experts' two grouped GEMMs: torch's bf16 one, or (fp8) the GEMMs of the fused MoE the engine's
    layer resolves, on the same operands."""
    cfg, dev = s.cfg, s.device
    D, inner, E = cfg.hidden_size, cfg.moe_intermediate_size[0], cfg.num_experts
    R = s.rows * s.n_block * cfg.moe_topk[0]
    moe = None if prec == "bf16" else platform.moe(MoESpec(
        num_experts=E, topk=cfg.moe_topk[0], hidden=D, inner=inner, dtype=torch.bfloat16, quant="fp8_row",
        fast_accum=a.fast_accum, grouped_fp8=a.grouped_fp8))
    for name, (o, i) in {"experts_gate_up": (2 * inner, D), "experts_down": (D, inner)}.items():
        x = torch.randn(R, i, device=dev, generator=g, dtype=torch.bfloat16)
        w = torch.randn(E, o, i, device=dev, generator=g, dtype=torch.bfloat16)
        if prec == "bf16":
            yield name, lambda x=x, w=w: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.bfloat16)
        else:
            yield name, _engine_grouped(a, platform, moe, name == "experts_gate_up", x, w, offs, res)
        x = w = None  # before the next shape's operands are drawn (a kept fp8 call holds its own)


def _engine_grouped(a, platform, moe, gate_up: bool, x, w, offs, res: dict):
    """The engine's grouped fp8 GEMM for ``w``, called on ``x``: the fused MoE's own GEMM where it has them (the
    cuda MoE: GEMM 1 with its SwiGLU epilogue where it runs one, which writes half of the plain build's output
    and ran 2.59 ms a layer in the engine on an H100 where the floor's plain build took 3.4-3.9 ms, BENCHMARKS.md
    "Forty-fifth session"), else the lone grouped GEMM ``kernels.grouped_fp8`` resolves."""
    if a.grouped_fp8 == "deepgemm":  # DeepGEMM serves the fused MoE; the lone grouped GEMM would time auto's kernel
        return _deepgemm_grouped(moe, x, w, offs, res)
    gemm = getattr(moe, "gemm13" if gate_up else "gemm2", None)
    if hasattr(gemm, "scaled"):  # the cuda MoE's e4m3 GEMMs; the reference MoE's take bf16 rows (the lone path)
        from omni.platforms.cuda.moe import pair_rows

        pw = gemm.prepare_weight(w)
        pw = pair_rows(pw) if gate_up and moe.paired is not None else pw  # the epilogue's row pairs
        res.setdefault("grouped_kernel", moe.name)
        xq, xs = Q.quantize_fp8(x, True)
        tokens = int(offs[-1]) // moe.spec.topk  # the MoE's bound on a group's rows, as its call passes it
        return lambda: gemm.scaled(xq, xs, pw, offs, tokens)
    E, o, i = w.shape
    kernel = platform.grouped_gemm(GroupedGemmSpec(
        num_experts=E, in_features=i, out_features=o, dtype=torch.bfloat16, quant="fp8_row",
        fast_accum=a.fast_accum, grouped_fp8=a.grouped_fp8))
    pw = kernel.prepare_weight(w)
    res.setdefault("grouped_kernel", kernel.name)
    pre_quantized = getattr(kernel, "scaled", None)  # the cuda kernels take e4m3 rows (the reference: x)
    if pre_quantized is None:
        return lambda: kernel(x, pw, offs)
    xq, xs = Q.quantize_fp8(x, True)
    return lambda: pre_quantized(xq, xs, pw, offs)


def _deepgemm_grouped(moe, x, w, offs, res: dict):
    """The DeepGEMM MoE's GEMM (``kernels.grouped_fp8: deepgemm``) on these groups in its padded layout, with the
    weight in its 128x128 blocks: what one expert GEMM of that MoE runs (the padding's rows included)."""
    from omni.platforms.cuda.deepgemm_moe import block_quantize
    from omni.platforms.cuda.padded_route import padded_rows

    pw = moe.kernel_layout(block_quantize(w))
    token_M, expert_M, _ = padded_rows(torch.arange(x.shape[0], device=x.device), offs, moe.align)
    xq, xs = Q.quantize_fp8(x, True)
    xq, xs = xq[token_M], xs[token_M]
    res.setdefault("grouped_kernel", f"{moe.name}: its GEMM on the padded layout")
    return lambda: moe.gemm(xq, xs, pw, expert_M)


def attention_operands(s: Setup, g) -> tuple:
    """Random q, k, v of the step's attention over both CFG rows' keys, and the engine's varlen tables."""
    cfg, dev, T = s.cfg, s.device, s.rows * s.n_block
    N, K, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    meta = _meta(s.runs, False, dev)
    S = meta.cu_seqlens_k_host[-1]
    q = torch.randn(T, N, H, device=dev, generator=g, dtype=torch.bfloat16)
    kk = torch.randn(S, K, H, device=dev, generator=g, dtype=torch.bfloat16)
    vv = torch.randn(S, K, H, device=dev, generator=g, dtype=torch.bfloat16)
    return q, kk, vv, meta


def _attention_kernel(s: Setup, g):
    """The layer's attention (the engine's kernel) on ``attention_operands``."""
    attn, operands = s.model.model.layers[0].self_attn.attn["none"], attention_operands(s, g)
    return lambda: attn(*operands)


def _rates(res: dict, s: Setup) -> None:
    """The layer's FLOPs, and the GEMMs' and attention's rates in each precision (into ``res``)."""
    meta = _meta(s.runs, False, s.device)
    keys = [lk for b in range(meta.num_seqs) for lk in
            [meta.cu_seqlens_k_host[b + 1] - meta.cu_seqlens_k_host[b]] *
            (meta.cu_seqlens_q_host[b + 1] - meta.cu_seqlens_q_host[b])]
    fl = res["flops_per_layer"] = step_flops(s.cfg, s.rows * s.n_block, keys)
    for prec in ("bf16", "fp8"):
        kt = res[prec]["kernels_s"]
        gemm_t = sum(v for n, v in kt.items() if n != "attention")
        res[prec]["gemm_tflops"] = (fl["dense"] + fl["routed"]) / gemm_t / 1e12
        res[prec]["attention_tflops"] = fl["attention"] / kt["attention"] / 1e12


def alone_rounds(kernels: dict, first: dict, rounds: int) -> dict:
    """The fp8 kernels timed alone again, ``rounds - 1`` more times, each round in another order (rotated), with
    their operands kept: the run-to-run spread of the floor timed alone. Each kernel's time depends on how hot
    the card is when its burst starts (the previous kernel's); the per-layer figure of the first pass stays the
    floor's, and this reports every round's total and the per-kernel medians beside it."""
    names, per_kernel = list(kernels), {n: [t] for n, t in first.items()}
    for r in range(1, rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            per_kernel[name].append(median_seconds(kernels[name], 20))
    totals = [sum(per_kernel[n][r] for n in names) for r in range(rounds)]
    medians = {n: statistics.median(v) for n, v in per_kernel.items()}
    print(f"[floor alone x{rounds}] per layer " + ", ".join(f"{t*1e3:.2f}" for t in totals) +
          f" ms (min {min(totals)*1e3:.2f}, max {max(totals)*1e3:.2f}); per-kernel medians sum to "
          f"{sum(medians.values())*1e3:.2f} ms", flush=True)
    return {"per_layer_s": totals, "step_32_layers_s": [t * RELEASED_LAYERS for t in totals],
            "kernels_median_s": medians, "per_layer_of_medians_s": sum(medians.values())}


def captured_alone(kernels: dict, chain: int = 8) -> dict:
    """Each fp8 kernel alone again, ``chain`` calls captured into one graph (as a captured step launches them):
    what the eager timing above adds per call (launch work on the host, an op's own small kernels) shows as the
    difference. A diagnostic beside the floor, which stays the eager first pass."""
    times = {}
    for name, fn in kernels.items():
        graph = captured(fn, chain)
        times[name] = median_seconds(graph.replay, 10) / chain
        del graph  # its pool's outputs go before the next kernel's graph
    total = sum(times.values())
    print(f"[floor captured alone] per layer {total*1e3:.2f} ms: " +
          ", ".join(f"{n} {t*1e3:.2f}" for n, t in times.items()), flush=True)
    return {"per_layer_s": total, "kernels_s": times, "step_32_layers_s": total * RELEASED_LAYERS}


def sustained_floor(kernels: dict, steps: int) -> dict:
    """The floor's kernels of one layer captured into one graph and replayed back to back, 32 layers a step,
    as the engine runs them: the clocks of sustained running under the power cap, which the kernels timed
    alone (a short burst each) do not see. Same kernels, same operands; only the running conditions differ."""
    graph = captured(lambda: [fn() for fn in kernels.values()])
    step_s = median_seconds(lambda: [graph.replay() for _ in range(RELEASED_LAYERS)], steps, warmup=3)
    layer_s = step_s / RELEASED_LAYERS
    print(f"[floor sustained] per layer {layer_s*1e3:.2f} ms (one graph of {len(kernels)} kernels, replayed "
          f"{RELEASED_LAYERS} times a step)", flush=True)
    return {"per_layer_s": layer_s, "step_32_layers_s": layer_s * RELEASED_LAYERS}
