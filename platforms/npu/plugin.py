"""The Huawei Ascend NPU platform: thin hook implementations over attention/gemm/graphs.

May assume: ``torch`` imports. Importing this module imports nothing else:
torch_npu is loaded by detection (see capabilities.py), never here, because
installing torch_npu without CANN breaks ``import torch`` and CI never has it.
Collectives use HCCL (backend ``"hccl"``, registered by torch_npu);
``omni_platform_configure`` is the one hook with a process-wide effect
(``torch.npu.set_device``).
"""
from __future__ import annotations

import torch

from omni.hookspecs import hookimpl
from omni.specs import AttentionSpec, CaptureSpec, GemmSpec, GroupedGemmSpec, PlatformInfo

from . import attention, gemm
from .capabilities import NpuCaps, detect_caps, platform_info, recipe_problems
from .graphs import GraphPools, NpuGraphRunner


class NpuPlatform:
    """Hook implementations of the ``npu`` platform (entry point ``omni.platforms: npu``)."""

    name = "npu"

    def __init__(self, caps: NpuCaps | None = None):
        self._caps = caps  # read lazily from the current device; tests may pass a made-up one
        self._pools = GraphPools()

    def device_caps(self) -> NpuCaps:  # a method, not a property: pluggy getattr()s every attribute
        if self._caps is None:
            self._caps = detect_caps(torch.npu.current_device())
        return self._caps

    @hookimpl
    def omni_platform_detect(self, reject) -> PlatformInfo | None:
        return platform_info(reject)

    @hookimpl
    def omni_check_recipe(self, recipe, info: PlatformInfo, reject) -> None:
        for problem in recipe_problems(recipe):
            reject(problem)

    @hookimpl
    def omni_platform_configure(self, info: PlatformInfo, local_rank: int) -> bool:
        torch.npu.set_device(local_rank)
        return True

    @hookimpl
    def omni_attention_impl(self, spec: AttentionSpec, reject):
        return attention.resolve(spec, self.device_caps(), reject)

    @hookimpl
    def omni_linear_impl(self, spec: GemmSpec, reject):
        return gemm.resolve_linear(spec, self.device_caps(), reject)

    @hookimpl
    def omni_grouped_gemm_impl(self, spec: GroupedGemmSpec, reject):
        return gemm.resolve_grouped(spec, self.device_caps(), reject)

    @hookimpl
    def omni_graph_runner_impl(self, spec: CaptureSpec, reject):
        if spec.device_type != "npu":
            return reject(f"npu: cannot capture a {spec.device_type!r} region")
        if not self.device_caps().graphs:
            return reject("npu: torch.npu.NPUGraph is missing (needs torch_npu >= 2.6)")
        return NpuGraphRunner(spec, self._pools)

    @hookimpl
    def omni_platform_shutdown(self, info: PlatformInfo) -> None:
        self._pools.clear()


plugin = NpuPlatform()
