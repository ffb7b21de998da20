"""The cuda platform's Triton kernels compiled for sm_90 by the real Triton compiler, without a GPU: the driver is a
stub (device 0, stream 0, an sm_90 target) and the tensors live on the CPU, so only compiles happen. It checks what
the interpreter cannot: each kernel, PDL's ``griddepcontrol`` included, compiles for Hopper, and
``pdl_triton.launch`` inside ``triton_compile.compiling()`` compiles each PDL class of a signature once (three
binaries), none again on a second call, with one compile thread or several.

Skipped where Triton is not installed (the CPU CI); where it is (a GPU host, or a CPU box with Triton added), it
needs no device. Each case runs in a child process: the stub driver must not reach a real GPU's tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
STUB = r"""
import json, sys
sys.path.insert(0, {bench!r})
import torch
from kernel_resources import stub_driver  # what JITFunction.run reads before it compiles: device 0, an sm_90 target

stub_driver()  # nothing launches inside compiling()


def binaries(kernel):
    return len(kernel.device_caches[0][0]) if 0 in kernel.device_caches else 0
""".format(bench=str(BENCH))


CHILD = STUB + r"""
from omni.platforms.cuda import glue_triton as gt, moe_triton as mt
from omni.platforms.cuda.glue import TritonGlue
from omni.platforms.cuda.pdl import Pdl
from omni.platforms.cuda.triton_compile import compiling
from omni.specs import GlueSpec

kernels = mt.TritonKernels(Pdl(64))
T, k, D, I = 16, 8, 256, 128
q, s = torch.zeros(T, D, dtype=torch.float8_e4m3fn), torch.ones(T, 1)
inverse = torch.arange(T * k)
x, w = torch.zeros(T, D, dtype=torch.bfloat16), torch.ones(D, dtype=torch.bfloat16)
h, y = torch.zeros(T * k, 2 * I, dtype=torch.bfloat16), torch.zeros(T * k, D, dtype=torch.bfloat16)
glue = TritonGlue(GlueSpec(hidden=D, head_dim=64, eps=1e-6, dtype=torch.bfloat16, topk=k, pdl_rows=64), kernels)
calls = {
    "scatter_rows": (mt._scatter_rows_kernel, lambda: kernels.scatter_rows(q, s, inverse)),
    "quant_rows": (mt._quant_kernel, lambda: kernels.quant_rows(x)),
    "swiglu": (mt._swiglu_kernel, lambda: kernels.swiglu(h, quantize=True)),
    "combine": (mt._combine_kernel, lambda: kernels.combine(y, inverse, torch.ones(T, k), torch.bfloat16, (x, x))),
    "add_rms_norm": (gt.norm_kernel, lambda: glue._norm(x, x, w, True)),
}
added = {}
for name, (kernel, call) in calls.items():
    for round in range(2):
        before = binaries(kernel)
        with compiling():
            call()
        added.setdefault(name, []).append(binaries(kernel) - before)
print(json.dumps({"classes": len(kernels.pdl.classes()), "added": added}))
"""


@pytest.mark.parametrize("threads", ["1", "3"])
def test_each_pdl_class_compiles_once_for_sm90_inside_the_compile_scope(threads, tmp_path):
    pytest.importorskip("triton")
    from omni.platforms.cuda.pdl_triton import HAS_GDC

    if not HAS_GDC:
        pytest.skip("this Triton has no griddepcontrol: kernels launch without PDL")
    env = {**os.environ, "OMNI_COMPILE_WORKERS": threads, "TRITON_CACHE_DIR": str(tmp_path)}  # empty: real compiles
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["classes"] == 3  # no PDL, the wait, the wait with the early launch
    assert got["added"] == {name: [3, 0] for name in got["added"]} and len(got["added"]) == 5
    assert len(list(tmp_path.rglob("*.cubin"))) == 15  # compiled here, not found in an older cache


PASS_CHILD = STUB + r"""
import pluggy
from omni import hookspecs
from omni.platforms.cuda import group_norm_triton as gn, moe_triton as mt, route_triton as rt, winograd_triton as wg
from omni.platforms.cuda.glue import TritonGlue
from omni.platforms.cuda.moe import torch_route_rows
from omni.platforms.cuda.pdl import Pdl
from omni.platforms.cuda.plugin import CudaPlatform
from omni.platforms.cuda.triton_compile import compile_only
from omni.reference_glue import ReferenceGlue
from omni.specs import GlueSpec

pm = pluggy.PluginManager(hookspecs.PROJECT)
pm.add_hookspecs(hookspecs)
pm.register(CudaPlatform())
T, E, k = 16, 64, 8
spec = GlueSpec(hidden=256, head_dim=64, eps=1e-6, dtype=torch.bfloat16, topk=k, pdl_rows=64, always_on=1)
kernels = mt.TritonKernels(Pdl(64))
glue = TritonGlue(spec, kernels)
logits = torch.randn(T, E, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
x = torch.randn(2, 32, 8, 8, dtype=torch.bfloat16)
m, count_before = torch.zeros(16, 2 * 4 * 4, 32), {}
watched = {"route": glue.k.route_kernel, "count": rt._count_kernel, "place": rt._place_kernel,
           "gn_stats": gn.stats_rows_kernel, "gn_finalize": gn.finalize_kernel, "gn_apply": gn.apply_rows_kernel,
           "wino_in": wg.input_kernel, "wino_out": wg.output_kernel}
before = {name: binaries(kern) for name, kern in watched.items()}
import time
t0 = time.perf_counter()
with pm.hook.omni_compile_scope(info=None):  # the platform's scope, through pluggy
    inside = compile_only()
    w, ids = glue._route(logits)
    routes = kernels.route_rows(ids[:, :k], E)
    y = gn.group_norm_act(x, 8, torch.ones(32), torch.zeros(32), 1e-6, norm_dtype=torch.float32,
                          out_dtype=torch.bfloat16)
    v = wg.input_transform(x)
    out = wg.output_transform(m, None, None, (2, 32, 8, 8), torch.bfloat16)
scope_s = time.perf_counter() - t0  # bench/compile_pass_cpu.py reads it
ref_w, ref_ids = ReferenceGlue(spec).route(logits)
ref_routes = torch_route_rows(ids[:, :k], E)
print(json.dumps({
    "inside": inside, "after": compile_only(),
    "route_is_the_reference": bool(torch.equal(w, ref_w) and torch.equal(ids, ref_ids)),
    "sort_is_torchs": all(bool(torch.equal(a, b)) for a, b in zip(routes, ref_routes)),
    "shapes": [list(y.shape), list(v.shape), list(out.shape)],
    "added": {name: binaries(kern) - before[name] for name, kern in watched.items()}, "scope_s": scope_s}))
"""


def test_the_platforms_compile_scope_compiles_every_kernel_of_a_pass_and_keeps_the_routes_defined(tmp_path):
    """``omni_compile_scope`` (the warm-up's compile pass) on the cuda platform: inside it the router and the
    expert sort compile their kernels and answer with the reference's torch ops (the experts' GEMMs index with
    them), and the GroupNorm and Winograd kernels, launched without PDL classes, compile instead of running."""
    pytest.importorskip("triton")
    from omni.platforms.cuda.pdl_triton import HAS_GDC

    env = {**os.environ, "OMNI_COMPILE_WORKERS": "3", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PASS_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["inside"] is True and got["after"] is False
    assert got["route_is_the_reference"] and got["sort_is_torchs"]
    assert got["shapes"] == [[2, 32, 8, 8], [16, 32, 32], [2, 32, 8, 8]]
    route_classes = 3 if HAS_GDC else 1  # a first launch compiles its PDL classes together
    assert got["added"] == {"route": route_classes, "count": 1, "place": 1, "gn_stats": 1, "gn_finalize": 1,
                            "gn_apply": 1, "wino_in": 1, "wino_out": 1}
    assert len(list(tmp_path.rglob("*.cubin"))) == route_classes + 7


PADDED_CHILD = STUB + r"""
from omni.platforms.cuda import moe_triton as mt, route_triton as rt
from omni.platforms.cuda.padded_route import torch_route_padded
from omni.platforms.cuda.triton_compile import compiling

kernels = mt.TritonKernels()
E, k, D, I = 64, 8, 256, 128
watched = {"one_block": rt._route_one_block_kernel, "count": rt._count_kernel, "place": rt._place_kernel,
           "quant": mt._quant_kernel, "swiglu": mt._swiglu_kernel}
added, defined = [], []
for round in range(2):
    before = {name: binaries(kern) for name, kern in watched.items()}
    with compiling():
        for T in (2, 16, 1100):  # one launch, chunks, blocks
            ids = torch.arange(T * k).remainder(E).reshape(T, k)
            route = kernels.route_padded(ids, E, 128)
            want = torch_route_padded(ids, E, 128)
            defined.append(all(bool(torch.equal(a, b)) for a, b in
                               zip((route.token_M, route.expert_M, route.inverse_R), (want.token_M, want.expert_M,
                                                                                      want.inverse_R))))
            M = route.expert_M.numel()
            kernels.quant_gather(torch.zeros(T, D, dtype=torch.bfloat16), route.token_M, route.expert_M)
            kernels.swiglu(torch.zeros(M, 2 * I, dtype=torch.bfloat16), True, expert_R=route.expert_M)
    added.append({name: binaries(kern) - before[name] for name, kern in watched.items()})
print(json.dumps({"added": added, "defined": all(defined)}))
"""


def test_the_padded_sort_and_the_skipping_kernels_compile_for_sm90_and_answer_torchs_layout_in_the_scope(tmp_path):
    """The DeepGEMM MoE's padded sort (``route_padded``: the sort's kernels with ``ALIGN`` 128) and the gather and
    SwiGLU that skip its padding rows compile for sm_90 in each of the sort's three launch plans, once; inside
    ``compiling()`` the sort answers with the torch definition's layout (the GEMMs index with it)."""
    pytest.importorskip("triton")
    env = {**os.environ, "OMNI_COMPILE_WORKERS": "2", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PADDED_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["defined"]
    # one launch; the chunks' and the blocks' count and place; quant and SwiGLU once each whatever the rows
    assert got["added"] == [{"one_block": 1, "count": 2, "place": 2, "quant": 1, "swiglu": 1},
                            {"one_block": 0, "count": 0, "place": 0, "quant": 0, "swiglu": 0}]


STEP_KERNELS = {"norm_kernel", "rope_norm_kernel", "route_kernel", "_count_kernel", "_place_kernel",
                "_scatter_rows_kernel", "_quant_kernel", "_swiglu_kernel", "_combine_kernel", "kv_kernel",
                "_skinny_fp8_kernel", "_grouped_skinny_fp8_kernel", "stats_cl_kernel", "finalize_kernel",
                "apply_cl_kernel", "stats_rows_kernel", "apply_rows_kernel", "input_kernel", "output_kernel"}


def test_no_kernel_of_a_step_spills_registers_or_touches_memory_before_its_pdl_wait(tmp_path):
    """``bench/kernel_resources.py``: every Triton kernel an image step, a decode step and the image heads launch,
    compiled for sm_90 at the released shapes, fits its registers (ptxas: no spill stores), and every binary of a
    PDL class lists no global load, store or atomic before its wait (SASS ``ACQBULK``): PDL's rule, whose breach
    would be a race a GPU run shows only now and then. The Winograd transforms are compiled with 8 values of a
    tile a thread (32 x 64 over 8 warps): the shipped 32 x 64 over 4 spills (BENCHMARKS.md, "Thirty-fourth
    session"), pending the device's timing of the two."""
    pytest.importorskip("triton")
    tool = BENCH / "kernel_resources.py"
    env = {**os.environ, "OMNI_COMPILE_WORKERS": "2", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "res.json"
    done = subprocess.run([sys.executable, str(tool), "--winograd-launch", "32x64x8", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["binaries"]
    assert {r["kernel"] for r in rows} == STEP_KERNELS
    assert [r for r in rows if r["spill_stores"] or r["spill_loads"]] == []
    assert all(0 < r["regs"] <= 255 for r in rows)
    waits = [r for r in rows if r["pdl"] != "-"]
    assert {r["kernel"] for r in waits} >= {"norm_kernel", "_quant_kernel", "_combine_kernel", "kv_kernel"}
    assert [(r["kernel"], r["memory_before_wait"]) for r in waits if r["memory_before_wait"]] == []


def test_every_image_size_runs_the_heads_and_vae_kernels_of_the_first(tmp_path):
    """``bench/kernel_resources.py --sizes``: the image heads' GroupNorm and Winograd kernels and the VAE's
    GroupNorm (decoder, and encoder for an edit's references), compiled for sm_90 at each of the 33 sizes of the
    Instruct ratio table, compile binaries at the first size only. Their image-size arguments are not specialized;
    with them specialized, 8 later sizes compiled 1-8 binaries each (46 in all against 19), every one in the first
    request of its size."""
    pytest.importorskip("triton")
    tool = BENCH / "kernel_resources.py"
    env = {**os.environ, "OMNI_COMPILE_WORKERS": "2", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "sizes.json"
    done = subprocess.run([sys.executable, str(tool), "--sizes", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(out.read_text())["sizes"]
    assert len(sizes) == 33 and sizes[0]["new_binaries"] > 0
    assert {tuple(r["size"]): r["kernels"] for r in sizes[1:] if r["new_binaries"]} == {}


FEW_ROWS_CHILD = STUB + r"""
from omni.platforms.cuda.grouped_skinny_triton import GroupedSkinnyFp8, _grouped_skinny_fp8_kernel as kern
from omni.platforms.cuda.pdl import Pdl
from omni.platforms.cuda.triton_compile import compiling

E4M3 = torch.float8_e4m3fn
pdl_rows, experts = int(sys.argv[1]), int(sys.argv[2])
built, added = {}, {}
for swiglu, (N, K) in ((True, (6144, 4096)), (False, (4096, 3072))):  # the released expert GEMMs
    few = GroupedSkinnyFp8(16, swiglu, pdl=Pdl(pdl_rows))
    before = binaries(kern)
    calls = few.compile_rows(experts, device="cpu")
    built[str(swiglu)] = [calls, binaries(kern) - before, few.compile_rows(experts, device="cpu")]
    w, ws = torch.empty(experts, N, K, dtype=E4M3), torch.ones(experts, N)  # uninitialised: only shapes compile
    before = binaries(kern)
    with compiling():  # every prompt of 1-16 tokens, routed to one expert or spread over several
        for R in range(1, 17):
            for offs in (torch.full((experts,), R), torch.arange(experts).clamp(max=R)):
                few(torch.zeros(R, K, dtype=E4M3), torch.ones(R), w, ws, offs.to(torch.int32), group_rows=R)
    added[str(swiglu)] = binaries(kern) - before
print(json.dumps({"built": built, "added": added}))
"""


@pytest.mark.parametrize("pdl_rows,experts", [(0, 64), (512, 64), (512, 65)])
def test_the_few_row_grouped_gemm_compiles_at_build_and_no_prompt_of_a_few_tokens_compiles_it_again(
        pdl_rows, experts, tmp_path):
    """``GroupedSkinnyFp8.compile_rows`` (the cuda MoE's build, ``moe.with_few_rows``) compiles the few-row
    grouped GEMM's binaries on small operands; then no call at the released expert shapes with 1-16 tokens compiles
    another. Before it, after an image server's warm-up, the first 3-word prompt compiled two binaries in its
    prefill (0.79-0.91 s on the H200). Without PDL (the image recipes), with it (Instruct: three classes a
    binary), and over 65 groups (``kernels.fuse_shared_expert``)."""
    pytest.importorskip("triton")
    from omni.platforms.cuda.pdl_triton import HAS_GDC

    env = {**os.environ, "OMNI_COMPILE_WORKERS": "2", "TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", FEW_ROWS_CHILD, str(pdl_rows), str(experts)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    classes = 3 if pdl_rows and HAS_GDC else 1
    assert got["built"] == {"True": [1, classes, 0], "False": [1, classes, 0]}
    assert got["added"] == {"True": 0, "False": 0}


LAUNCHER_CHILD = STUB + r"""
from pathlib import Path
from triton.backends.nvidia.driver import CudaLauncher
from kernel_resources import stand_in_libcuda
from omni.platforms.cuda import moe_triton as mt
from omni.platforms.cuda.pdl import Pdl
from omni.platforms.cuda.triton_compile import _launcher_key, compiling

cache = Path(sys.argv[1])
stand_in_libcuda(Path(sys.argv[2]))
stub_driver(launchers=True)  # the real launcher builder; its C compile needs no device


def launchers():
    return sorted(str(p) for p in cache.rglob("__triton_launcher*.so"))


kernels = mt.TritonKernels(Pdl(0))
T, k, D, I = 16, 8, 256, 128
x, h = torch.zeros(T, D, dtype=torch.bfloat16), torch.zeros(T * k, 2 * I, dtype=torch.bfloat16)
y, inverse = torch.zeros(T * k, D, dtype=torch.bfloat16), torch.arange(T * k)
with compiling():
    kernels.quant_rows(x)
    kernels.swiglu(h, quantize=True)
    kernels.combine(y, inverse, torch.ones(T, k), torch.bfloat16, (x, x))
built = launchers()
compiled = [kern for jit in (mt._quant_kernel, mt._swiglu_kernel, mt._combine_kernel)
            for kern in jit.device_caches[0][0].values()]
for kern in compiled:  # what a first launch does: each finds its launcher in Triton's cache, none is compiled
    CudaLauncher(kern.src, kern.metadata)
print(json.dumps({"binaries": len(compiled), "built": len(built), "after_first_launches": launchers() == built,
                  "signatures": len({_launcher_key(kern) for kern in compiled})}))
"""


@pytest.mark.parametrize("threads", ["1", "2"])
def test_the_compile_scope_builds_each_kernels_launcher_so_its_first_launch_compiles_nothing(threads, tmp_path):
    """Triton builds a kernel's host launcher (C, with the host's compiler) at its first launch, not at its compile:
    after a compile pass the first prompt of a few tokens still spent 0.19 s more than a longer one in its
    prefill with no binary compiled (H100, BENCHMARKS.md "Thirty-sixth session"). ``compiling()`` now builds
    them on its pool as it leaves, one per distinct signature; a first launch then finds each in Triton's cache.
    The launchers link against a stand-in libcuda (``kernel_resources.stand_in_libcuda``): nothing launches."""
    pytest.importorskip("triton")
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: Triton builds its launchers with one")
    cache = tmp_path / "cache"
    env = {**os.environ, "OMNI_COMPILE_WORKERS": threads, "TRITON_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", LAUNCHER_CHILD, str(cache), str(tmp_path / "libcuda")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["binaries"] == 3 and got["built"] == got["signatures"] >= 1, got
    assert got["after_first_launches"], "a launcher was compiled at its kernel's first launch"
