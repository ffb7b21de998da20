"""The Moore Threads (MUSA) platform: the hook implementations of ``DevicePlatform`` over this package.

May assume: ``torch`` imports. Importing this module imports nothing else:
torch_musa is loaded by detection (see capabilities.py). Collectives use
MCCL (backend ``"mccl"``, registered by torch_musa); GEMMs are declined
(gemm.py says why; the reference's ``F.linear`` and expert loop serve them).
``omni_platform_configure`` is the one hook with a process-wide effect
(``torch.musa.set_device``). Regions are captured with ``torch.musa.MUSAGraph``.
"""
from __future__ import annotations

from omni.platforms.common.graphs import GraphApi
from omni.platforms.common.plugin import DevicePlatform

from . import attention, capabilities, gemm


class MusaPlatform(DevicePlatform):
    """Hook implementations of the ``musa`` platform (entry point ``omni.platforms: musa``)."""

    name = "musa"
    graphs = GraphApi(device_type="musa", graph_class="MUSAGraph", label="musa-graph")
    capabilities, attention, gemm = capabilities, attention, gemm  # what the shared hooks call

    def graphs_missing(self) -> str | None:
        return None if self.device_caps().graphs else "musa: torch.musa.MUSAGraph is missing in this torch_musa"


plugin = MusaPlatform()
