"""Registers, spills and shared memory of the cuda platform's Triton kernels at the released shapes, as ptxas
reports them for the sm_90 binaries (``ptxas -v``, the run Triton makes): a check that needs no GPU.

Why: a kernel that spills registers to local memory, or holds so many that few warps fit on an SM, loses its rate
to that, which a timing on the GPU shows only as "slow". Triton's compiler picks registers per binary; this lists
them for every launch class an image step (8194 packed tokens: two CFG rows of 4097), a decode step (8 answers:
its row kernels, its sort and its few-row GEMMs) and the image heads make, so a change to a tile or a block size
can be checked before device time is spent.

How: each kernel is launched inside ``triton_compile.compiling()`` (compiled, not run) on the shapes the engine
gives it; on a CPU box under a stub driver (device 0, an sm_90 target), with tensors that say they are on CUDA so
the glue takes its Triton path. Every binary lands in an empty ``TRITON_CACHE_DIR``; Triton's own ptxas is
run again on each one's PTX with ``-v`` (Triton drops that log). On a GPU host it compiles for that GPU.

    PYTHONPATH=/tmp/tri python bench/kernel_resources.py --json out.json   # Triton added to a CPU box's path
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

TOKENS = 8194  # an image step at 1024x1024 with CFG: two rows of 4097 (prefix + 4096 image tokens)
DECODE_TOKENS = 8  # a decode step of 8 answers: the row kernels' and the sort's classes launched under PDL
PDL_ROWS = 512  # kernels.pdl_rows of the Instruct recipes (h200_instruct_fp8): calls of up to 512 rows wait


class OnDevice(torch.Tensor):
    """A CPU tensor the glue's ``is_cuda`` checks take for a device one (nothing runs inside the compile scope)."""

    @property
    def is_cuda(self):
        return True


def stub_driver(launchers: bool = False) -> None:
    """Triton's active driver replaced by one that reports device 0 with an sm_90 target (no GPU here);
    ``launchers``: with Triton's real launcher builder too (needs ``stand_in_libcuda`` first)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class Stub:  # what JITFunction.run reads before it compiles
        if launchers:
            from triton.backends.nvidia.driver import CudaLauncher as launcher_cls
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    driver.set_active(Stub())


STAND_IN_CALLS = ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuFuncSetAttribute",
                  "cuGetErrorString", "cuPointerGetAttribute", "cuLaunchKernelEx", "cuTensorMapEncodeTiled")


def stand_in_libcuda(where: Path) -> Path:
    """A ``libcuda.so.1`` in ``where`` that defines only the driver calls Triton's launchers link to (each returns
    0: nothing launches on a CPU box), loaded into this process, with ``TRITON_LIBCUDA_PATH`` pointing at it: Triton
    then builds and loads kernel launchers (C, with the host's compiler) as on a GPU host. Needs a C compiler."""
    import ctypes

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc): Triton builds its launchers with one")
    where.mkdir(parents=True, exist_ok=True)
    src, lib = where / "cuda.c", where / "libcuda.so.1"
    src.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in STAND_IN_CALLS))
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)], check=True)
    (where / "libcuda.so").unlink(missing_ok=True)
    (where / "libcuda.so").symlink_to(lib.name)  # what the launcher links against (-lcuda)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)  # a launcher's libcuda.so.1 is then this one, already loaded
    os.environ["TRITON_LIBCUDA_PATH"] = str(where)
    return where


def dev(*shape, dtype=torch.bfloat16, fill=0) -> torch.Tensor:
    """``fill`` everywhere; past 64 MiB uninitialized (a compile reads shapes, dtypes and alignment only)."""
    if torch.Size(shape).numel() * dtype.itemsize > 1 << 26:
        return torch.empty(shape, dtype=dtype).as_subclass(OnDevice)
    t = torch.full(shape, fill, dtype=torch.float32).to(dtype) if dtype.is_floating_point else torch.full(
        shape, fill, dtype=dtype)
    return t.as_subclass(OnDevice)


def channels_last(*shape) -> torch.Tensor:
    """``[B, C, H, W]`` bf16 in the layout the model keeps the heads' and the VAE's activations on cuda (a unit
    channel stride, which Triton specializes: the loads along channels vectorize)."""
    return dev(*shape).contiguous(memory_format=torch.channels_last).as_subclass(OnDevice)


def step_calls(cfg, tokens: int, fused_shared: bool):
    """(label, call) for each memory-bound kernel a decoder layer launches on ``tokens`` packed rows."""
    from omni.platforms.cuda.glue import TritonGlue
    from omni.platforms.cuda.moe_triton import TritonKernels
    from omni.platforms.cuda.pdl import Pdl
    from omni.specs import GlueSpec

    D, H, E, k = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.moe_topk[0]
    N, K, inner = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.moe_intermediate_size[0]
    extra = 1 if fused_shared else 0
    kernels = TritonKernels(Pdl(PDL_ROWS))
    glue = TritonGlue(GlueSpec(hidden=D, head_dim=H, eps=cfg.rms_norm_eps, dtype=torch.bfloat16, topk=k,
                               pdl_rows=PDL_ROWS, always_on=extra), kernels)
    T, R = tokens, tokens * (k + extra)
    x, w = dev(T, D), dev(D, fill=1)
    inverse = torch.arange(R).as_subclass(OnDevice)
    return [
        ("rms_norm + e4m3", lambda: glue.rms_norm(x, w, True)),
        ("add + rms_norm + e4m3", lambda: glue.add_rms_norm(x, x, w, True)),
        ("rope + qk-norm", lambda: glue.rope_qk_norm(dev(T, (N + 2 * K) * H), dev(T, H), dev(T, H), dev(H), dev(H),
                                                    (N, K))),
        ("router", lambda: glue.route(dev(T, E))),
        ("sort by expert", lambda: kernels.route_rows(
            (torch.arange(T * (k + extra)) % (E + extra)).reshape(T, k + extra).as_subclass(OnDevice), E + extra)),
        ("scatter e4m3 rows", lambda: kernels.scatter_rows(dev(T, D, dtype=torch.float8_e4m3fn), dev(T, 1), inverse)),
        ("e4m3 rows of h", lambda: kernels.quant_rows(dev(R, inner))),
        ("e4m3 rows of o_proj's input", lambda: kernels.quant_rows(dev(T, N * H))),
        ("shared SwiGLU + e4m3", lambda: glue.swiglu(dev(T, 2 * inner), True)),
        ("combine + 2 residuals", lambda: kernels.combine(dev(R, D), inverse, dev(T, k + extra), torch.bfloat16,
                                                          (x, x))),
        ("KV store + gather", lambda: glue.store_gather_kv(
            dev(2 * T, K, H), dev(2 * T, K, H), dev(T, K, H), dev(T, K, H), torch.arange(T).as_subclass(OnDevice),
            torch.arange(T).as_subclass(OnDevice), torch.full((T,), -1).as_subclass(OnDevice))),
    ]


def few_row_calls(cfg):
    """The dense and grouped e4m3 GEMMs for a decode step's few rows: one call per binary (row class)."""
    from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8
    from omni.platforms.cuda.pdl import Pdl
    from omni.platforms.cuda.skinny_triton import SkinnyFp8

    D, E, inner = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size[0]
    dense = SkinnyFp8(64, pdl=Pdl(PDL_ROWS))
    e4m3 = torch.float8_e4m3fn
    calls = [(f"few-row dense e4m3 GEMM, {m} rows", lambda m=m: dense(
        dev(m, D, dtype=e4m3), dev(m, 1), dev(D, D, dtype=e4m3), dev(D), torch.bfloat16))
        for m in dense.launches().values()]
    for swiglu, (n, kk) in ((True, (2 * inner, D)), (False, (D, inner))):
        grouped = GroupedSkinnyFp8(64, swiglu, pdl=Pdl(PDL_ROWS))
        for limit, _ in grouped.tiles:
            rows = min(limit, 64)
            calls.append((f"few-row grouped e4m3 GEMM{' + SwiGLU' if swiglu else ''}, groups <= {rows} rows",
                          lambda g=grouped, r=rows, n=n, kk=kk: g(
                              dev(r, kk, dtype=e4m3), dev(r), dev(E, n, kk, dtype=e4m3), dev(E, n),
                              torch.full((E,), r, dtype=torch.int32).as_subclass(OnDevice))))
    return calls


VAE_LEVELS = ((1024, 1), (1024, 2), (512, 4), (256, 8), (128, 16))  # decoder (channels, grid scale) of a level
# the encoder's levels (channels, frames, downsampling): a reference image as 4 frames, halved twice in time; its
# activations stay [B, C, T, H, W] contiguous (only the decoder goes channels-last)
ENCODER_LEVELS = ((128, 4, 1), (256, 4, 2), (512, 4, 4), (1024, 2, 8), (1024, 1, 16))


def head_calls(launch=None, grid=(64, 64)):
    """GroupNorm (+ SiLU) and the Winograd transforms (``launch``: their launch shape, the shipped one by default)
    as the image heads and the VAE (decoder; encoder, for a reference image of an edit) make them for an image of
    latent ``grid`` (64 x 64: 1024 x 1024)."""
    from omni.platforms.cuda import group_norm_triton as gn, winograd_triton as wg

    h, w = grid
    th, tw = wg.tiles(h, w)

    def gnorm(c, hh, ww):
        x = channels_last(1, c, hh, ww)
        return lambda: gn.group_norm_act(x, 32, dev(c, fill=1), dev(c), 1e-6, norm_dtype=torch.float32,
                                         out_dtype=torch.bfloat16, silu=True)

    def gnorm_encoder(c, t, hh, ww):
        x = dev(1, c, t, hh, ww)
        return lambda: gn.group_norm_act(x, 32, dev(c, fill=1), dev(c), 1e-6, norm_dtype=torch.float32,
                                         out_dtype=torch.bfloat16, silu=True)

    calls = [(f"GroupNorm + SiLU, {c} channels at {h * f}x{w * f}", gnorm(c, h * f, w * f)) for c, f in VAE_LEVELS]
    calls += [(f"VAE encoder GroupNorm + SiLU, {c} channels, {t} frames at {h * 16 // f}x{w * 16 // f}",
               gnorm_encoder(c, t, h * 16 // f, w * 16 // f)) for c, t, f in ENCODER_LEVELS]
    calls.append((f"GroupNorm + SiLU, 4096 channels at {h}x{w}", gnorm(4096, h, w)))
    for rows, ci, co, skip in ((1, 1024, 4096, False), (1, 4096, 4096, True), (2, 4096, 1024, False)):
        calls.append((f"Winograd input transform, {rows} x {ci} channels",
                      lambda r=rows, ci=ci: wg.input_transform(channels_last(r, ci, h, w), launch)))
        calls.append((f"Winograd output transform, {rows} x {co} channels{' + skip' if skip else ''}",
                      lambda r=rows, co=co, skip=skip: wg.output_transform(
                          dev(16, r * th * tw, co, dtype=torch.float32), dev(co),
                          channels_last(r, co, h, w) if skip else None, (r, co, h, w), torch.bfloat16, launch)))
    return calls


def size_sweep(cache: Path, launch=None) -> list[dict]:
    """The heads' and the VAE's kernels at each size of the Instruct ratio table (``resolution.ratio_table``), in
    its order: the binaries each size compiled that no size before it had (a server meets them in the first
    request of that size)."""
    from omni.models.hunyuan_image3.resolution import ratio_table
    from omni.platforms.cuda.triton_compile import compiling

    seen, out = set(cache.rglob("*.ptx")), []
    for height, width in ratio_table():
        with compiling():
            for _, call in head_calls(launch, (height // 16, width // 16)):
                call()
        new = [p for p in cache.rglob("*.ptx") if p not in seen]
        seen.update(new)
        out.append({"size": [height, width], "new_binaries": len(new),
                    "kernels": sorted(json.loads(p.with_suffix(".json").read_text())["name"] for p in new)})
        print(f"{height}x{width}: {len(new)} new binaries {out[-1]['kernels']}", file=sys.stderr, flush=True)
    return out


def ptxas() -> str:
    """The ptxas Triton compiles with (its bundled one, or ``TRITON_PTXAS_PATH``)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def usage(ptx: Path, tool: str, arch: str) -> dict:
    """Registers, stack frame and spill bytes a thread of the PTX's kernel gets (``ptxas -v``, as Triton runs it)."""
    log = subprocess.run([tool, "-v", f"--gpu-name={arch}", str(ptx), "-o", os.devnull], capture_output=True,
                         text=True, check=True).stderr
    return parse_ptxas(log)


def parse_ptxas(log: str) -> dict:
    """``{"regs", "stack", "spill_stores", "spill_loads"}`` from ``ptxas -v``'s report of one function."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not (regs and frame):
        raise ValueError(f"no register report in ptxas's output: {log[-500:]!r}")
    return {"regs": int(regs.group(1)), "stack": int(frame.group(1)), "spill_stores": int(frame.group(2)),
            "spill_loads": int(frame.group(3))}


GLOBAL_MEMORY = re.compile(r"\b(LDG|STG|ATOMG|ATOM|RED|LDGSTS|UTMALDG|UTMASTG|UBLKCP)\b")


def reads_before_wait(cubin: Path) -> int:
    """Global loads, stores and atomics the SASS lists before its first ``ACQBULK`` (``griddepcontrol.wait``).
    PDL's rule (``pdl_triton``): a kernel waits before it touches memory an earlier kernel writes or reads; in
    the straight-line prologue where the wait sits, listing order is program order."""
    from triton import knobs

    sass = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return memory_before_wait(sass)


def memory_before_wait(sass: str) -> int:
    """Global memory instructions listed before the first ``ACQBULK`` of a SASS listing (all of them if none)."""
    return len(GLOBAL_MEMORY.findall(sass.split("ACQBULK", 1)[0]))


def pdl_class(ptx_text: str) -> str:
    """Which of a kernel's PDL classes the binary is: no PDL, waits, or waits and lets the next kernel launch."""
    if "griddepcontrol.launch_dependents" in ptx_text:
        return "wait+trigger"
    return "wait" if "griddepcontrol.wait" in ptx_text else "-"


def compile_each(calls, cache: Path, tool: str) -> list[dict]:
    """Each call compiled inside the scope; the binaries it added and their resources."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    from omni.platforms.cuda.triton_compile import compiling

    rows, seen = [], set()
    for label, call in calls:
        with compiling():
            call()
        new = sorted(p for p in cache.rglob("*.ptx") if p not in seen)
        seen.update(new)
        for ptx in new:
            meta = json.loads(ptx.with_suffix(".json").read_text())
            pdl = pdl_class(ptx.read_text())
            rows.append({"call": label, "kernel": meta["name"], "warps": meta["num_warps"], "pdl": pdl,
                         "shared": meta["shared"],
                         "memory_before_wait": reads_before_wait(ptx.with_suffix(".cubin")) if pdl != "-" else None}
                        | usage(ptx, tool, sm_arch_from_capability(meta["target"]["arch"])))
        print(f"{label}: {len(new)} binaries", file=sys.stderr, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=TOKENS, help="packed rows of the image step (default %(default)s)")
    p.add_argument("--no-fused-shared", action="store_true", help="the shared expert outside the routed groups")
    p.add_argument("--winograd-launch", default=None, metavar="RxCxW",
                   help="the Winograd transforms' launch shape: tiles x channels x warps (default: the shipped one)")
    p.add_argument("--sizes", action="store_true",
                   help="instead: the heads' and the VAE's binaries compiled at each size of the ratio table")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="omni-res-")  # empty: every binary compiles here
    if not torch.cuda.is_available():
        stub_driver()
    from omni.memory_estimate import released_config

    cfg, tool = released_config(), ptxas()
    from omni.platforms.cuda.winograd_triton import Launch

    try:
        launch = Launch.parse(a.winograd_launch) if a.winograd_launch else None
    except ValueError as e:
        p.error(f"--winograd-launch: {e}")
    if a.sizes:
        return sweep_main(a, launch)
    rows = compile_each(every_call(cfg, a, launch), Path(os.environ["TRITON_CACHE_DIR"]), tool)
    report(rows)
    if a.json:
        a.json.write_text(json.dumps({"tokens": a.tokens, "target": _target(), "winograd_launch": a.winograd_launch,
                                      "binaries": rows}, indent=1))
    return 0


def every_call(cfg, a, launch) -> list:
    """The image step's calls, the decode step's, the few-row GEMMs' and the heads' and VAE's."""
    fused = not a.no_fused_shared
    decode = [(f"{label}, {DECODE_TOKENS} tokens", call) for label, call in step_calls(cfg, DECODE_TOKENS, fused)]
    return step_calls(cfg, a.tokens, fused) + decode + few_row_calls(cfg) + head_calls(launch)


def report(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['call']:<56} {r['kernel']:<28} {r['pdl']:<12} warps {r['warps']:>2} regs {r['regs']:>3} "
              f"spill stores {r['spill_stores']:>4} B  shared {r['shared']:>6} B")
    spilled = [r for r in rows if r["spill_stores"]]
    early = [r for r in rows if r["memory_before_wait"]]
    print(f"{len(rows)} binaries, {len(spilled)} spill registers: {sorted({r['kernel'] for r in spilled}) or 'none'}; "
          f"{sum(r['pdl'] != '-' for r in rows)} wait under PDL, {len(early)} touch memory before the wait: "
          f"{sorted({r['kernel'] for r in early}) or 'none'}", flush=True)


def sweep_main(a, launch) -> int:
    sizes = size_sweep(Path(os.environ["TRITON_CACHE_DIR"]), launch)
    total = sum(r["new_binaries"] for r in sizes)
    print(f"{len(sizes)} sizes: {total} binaries, {sizes[0]['new_binaries']} at the first; "
          f"{sum(1 for r in sizes[1:] if r['new_binaries'])} later sizes compiled more", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"target": _target(), "winograd_launch": a.winograd_launch, "sizes": sizes,
                                      "binaries": total}, indent=1))
    return 0


def _target() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "sm_90 (stub driver, no GPU)"


if __name__ == "__main__":
    raise SystemExit(main())
