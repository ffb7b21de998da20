"""The Intel GPU (XPU) platform: thin hook implementations over attention/gemm/graphs.

May assume: ``torch`` imports (``torch.xpu`` is core). Importing this module
does nothing else: no device query, no IPEX import, no torch flag.
Collectives use XCCL (or oneCCL's ``"ccl"`` on older stacks, whose bindings
``omni_platform_configure`` imports, the one hook with process-wide effects,
along with ``torch.xpu.set_device``).
"""
from __future__ import annotations

import importlib

import torch

from omni.hookspecs import hookimpl
from omni.specs import AttentionSpec, CaptureSpec, GemmSpec, GroupedGemmSpec, PlatformInfo

from . import attention, gemm
from .capabilities import ONECCL, XpuCaps, detect_caps, platform_info, recipe_problems
from .graphs import GraphPools, XpuGraphRunner


class XpuPlatform:
    """Hook implementations of the ``xpu`` platform (entry point ``omni.platforms: xpu``)."""

    name = "xpu"

    def __init__(self, caps: XpuCaps | None = None):
        self._caps = caps  # read lazily from the current device; tests may pass a made-up one
        self._pools = GraphPools()

    def device_caps(self) -> XpuCaps:  # a method, not a property: pluggy getattr()s every attribute
        if self._caps is None:
            self._caps = detect_caps(torch.xpu.current_device())
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
        if info.dist_backend == "ccl":
            importlib.import_module(ONECCL)  # registers the "ccl" backend with torch.distributed
        torch.xpu.set_device(local_rank)
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
        if spec.device_type != "xpu":
            return reject(f"xpu: cannot capture a {spec.device_type!r} region")
        if not self.device_caps().graphs:
            return reject("xpu: torch.xpu.XPUGraph is missing (needs PyTorch >= 2.11)")
        return XpuGraphRunner(spec, self._pools)

    @hookimpl
    def omni_platform_shutdown(self, info: PlatformInfo) -> None:
        self._pools.clear()


plugin = XpuPlatform()
