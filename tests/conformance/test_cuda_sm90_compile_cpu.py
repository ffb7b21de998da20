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

import pytest

CHILD = r"""
import json, sys
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class StubDriver:  # what JITFunction.run reads before it compiles; nothing launches inside compiling()
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(StubDriver())
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
        before = len(kernel.device_caches[0][0]) if 0 in kernel.device_caches else 0
        with compiling():
            call()
        added.setdefault(name, []).append(len(kernel.device_caches[0][0]) - before)
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
