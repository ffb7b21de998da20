"""Which parallel layouts may record their denoising step into a device graph (issue 17, item 4).

- tp and cfg may: tp's all-reduces have fixed shapes and the platform is told which backend issues them
  (``CaptureSpec.collectives``, from ``ParallelRuntime.step_collectives``); cfg's exchange runs between replays.
- ep and sequence parallelism may not: their reasons name the field, at build, before anything is allocated.
- The platforms: CUDA records NCCL collectives and refuses gloo's; ROCm and the reference record none.

Real process groups (gloo, two spawned ranks) answer the backend. The captured tp and cfg steps against their
eager runs on a GPU: tests/gpu/test_gpu_parallel_capture.py; the region's spec carrying the backend:
tests/test_step_graphs.py.
"""
from __future__ import annotations

import pytest
import torch

from omni.build_options import BuildOptions
from omni.parallel.launch import launch
from omni.parallel.mesh import Degrees
from omni.parallel.runtime import ParallelRuntime, SingleDevice
from omni.specs import CaptureSpec

from test_mesh_and_plan import fake_mesh

pytestmark = pytest.mark.timeout(120)


def test_real_groups_name_the_backend_of_the_step_collectives():
    labels = ["tp2", "cfg2", "ulysses2", "ring2", "tp2xep2"]
    per_rank = launch("workers:capture_report", Degrees(tp=2), args=(labels,), timeout_s=90)
    assert per_rank[0] == per_rank[1]
    report = per_rank[0]
    assert report["tp2"] == (None, "gloo"), "tp records its all-reduces; the platform is told they are gloo's"
    assert report["cfg2"] == (None, ""), "cfg exchanges between replays: nothing inside the step"
    assert "parallel.ulysses=2" in report["ulysses2"][0] and "parallel.ring=2" in report["ring2"][0]
    assert "parallel.ep=2" in report["tp2xep2"][0] and "host" in report["tp2xep2"][0]


@pytest.mark.parametrize("label,field", [("ulysses2", "parallel.ulysses=2"), ("ring2", "parallel.ring=2"),
                                         ("tp2xep2", "parallel.ep=2")])
def test_capture_with_ep_or_sp_is_refused_at_build_naming_the_field(label, field):
    from omni.models.hunyuan_image3.build import build_transformer
    from omni.models.hunyuan_image3.config import TINY_GOLDEN
    from omni.platform_manager import select

    platform = select("cpu")
    runtime = ParallelRuntime(fake_mesh(Degrees.parse(label)), platform)
    with pytest.raises(ValueError, match=rf"graph\.mode=capture: {field}.*use graph\.mode=eager"):
        build_transformer(TINY_GOLDEN, platform, BuildOptions(dtype=torch.float32, capturable=True),
                          parallel=runtime)
    build_transformer(TINY_GOLDEN, platform, BuildOptions(dtype=torch.float32), parallel=runtime)  # eager: builds


def test_single_device_and_tp_cfg_layouts_are_recordable():
    assert SingleDevice().capture_refusal() is None and SingleDevice().step_collectives == ""
    for label in ("tp2", "cfg2", "cfg2xtp2", "dp2"):
        assert ParallelRuntime(fake_mesh(Degrees.parse(label)), None).capture_refusal() is None, label


def test_cuda_records_nccl_collectives_and_refuses_gloo():
    from omni.platforms.cuda.plugin import plugin as cuda
    from omni.platforms.rocm.plugin import plugin as rocm

    spec = lambda backend: CaptureSpec(device_type="cuda", name="denoise_step[probe]",  # noqa: E731
                                       collectives=backend)
    assert cuda.capture_refusal(spec("nccl")) is None and cuda.capture_refusal(spec("")) is None
    refusal = cuda.capture_refusal(spec("gloo"))
    assert "'gloo' collectives cannot be recorded" in refusal and "nccl" in refusal and "graph.mode=eager" in refusal
    assert "'nccl' collectives cannot be recorded" in rocm.capture_refusal(spec("nccl")), "RCCL capture: not declared"
    assert rocm.capture_refusal(spec("")) is None
