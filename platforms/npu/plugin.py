"""The Huawei Ascend NPU platform: the hook implementations of ``DevicePlatform`` over this package.

May assume: ``torch`` imports. Importing this module imports nothing else:
torch_npu is loaded by detection (see capabilities.py), never here, because
installing torch_npu without CANN breaks ``import torch`` and CI never has it.
Collectives use HCCL (backend ``"hccl"``, registered by torch_npu);
``omni_platform_configure`` is the one hook with a process-wide effect
(``torch.npu.set_device``).

Graphs ("aclgraph", ``torch.npu.NPUGraph``, torch_npu >= 2.6): only aclnn ops
are captured; FIA is capturable, with its host sequence lengths baked into
the graph, so the engine captures one graph per shape bucket (updating the
lengths between replays needs a replay-time hook the contract does not have yet).
"""
from __future__ import annotations

from omni.platforms.common.graphs import GraphApi
from omni.platforms.common.plugin import DevicePlatform

from . import attention, capabilities, gemm


class NpuPlatform(DevicePlatform):
    """Hook implementations of the ``npu`` platform (entry point ``omni.platforms: npu``)."""

    name = "npu"
    graphs = GraphApi(device_type="npu", graph_class="NPUGraph", label="npu-graph")
    capabilities, attention, gemm = capabilities, attention, gemm  # what the shared hooks call

    def graphs_missing(self) -> str | None:
        return None if self.device_caps().graphs else "npu: torch.npu.NPUGraph is missing (needs torch_npu >= 2.6)"


plugin = NpuPlatform()
