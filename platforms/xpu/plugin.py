"""The Intel GPU (XPU) platform: the hook implementations of ``DevicePlatform`` over this package.

May assume: ``torch`` imports (``torch.xpu`` is core). Importing this module
does nothing else: no device query, no IPEX import, no torch flag.
Collectives use XCCL (or oneCCL's ``"ccl"`` on older stacks, whose bindings
``omni_platform_configure`` imports, the one hook with process-wide effects,
along with ``torch.xpu.set_device``). Regions are captured with
``torch.xpu.XPUGraph`` (PyTorch >= 2.11).
"""
from __future__ import annotations

import importlib

from omni.hookspecs import hookimpl
from omni.platforms.common.graphs import GraphApi
from omni.platforms.common.plugin import DevicePlatform
from omni.specs import PlatformInfo

from . import attention, capabilities, gemm
from .capabilities import ONECCL


class XpuPlatform(DevicePlatform):
    """Hook implementations of the ``xpu`` platform (entry point ``omni.platforms: xpu``)."""

    name = "xpu"
    graphs = GraphApi(device_type="xpu", graph_class="XPUGraph", label="xpu-graph")
    capabilities, attention, gemm = capabilities, attention, gemm  # what the shared hooks call

    def graphs_missing(self) -> str | None:
        return None if self.device_caps().graphs else "xpu: torch.xpu.XPUGraph is missing (needs PyTorch >= 2.11)"

    @hookimpl
    def omni_platform_configure(self, info: PlatformInfo, local_rank: int) -> bool:
        if info.dist_backend == "ccl":
            importlib.import_module(ONECCL)  # registers the "ccl" backend with torch.distributed
        return super().omni_platform_configure(info, local_rank)


plugin = XpuPlatform()
