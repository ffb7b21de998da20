"""The AMD ROCm platform: the hook implementations of ``DevicePlatform`` over this package.

May assume: ``torch`` imports. Importing this module does nothing else: no
device query, no vendor import, no torch flag. ROCm keeps torch's CUDA
surface (device type ``"cuda"``, ``torch.cuda``, RCCL behind the ``"nccl"``
backend, HIP graphs behind ``torch.cuda.CUDAGraph``); what differs is the
detection (``torch.version.hip``), the attention library (aiter) and the
FP8 format (fnuz on MI300-class). Detection reads the build and the device
count only; ``omni_platform_configure`` is the one hook with a process-wide
effect (``torch.cuda.set_device``). Graph runners are named ``hip-graph``
so traces say which graph kind ran.
"""
from __future__ import annotations

from omni.platforms.common.graphs import GraphApi
from omni.platforms.common.plugin import DevicePlatform
from omni.specs import CaptureSpec

from . import attention, capabilities, gemm


class RocmPlatform(DevicePlatform):
    """Hook implementations of the ``rocm`` platform (entry point ``omni.platforms: rocm``)."""

    name = "rocm"
    graphs = GraphApi(device_type="cuda", graph_class="CUDAGraph", label="hip-graph")
    capabilities, attention, gemm = capabilities, attention, gemm  # what the shared hooks call
    # RCCL reads NCCL_HOSTID as NCCL does (rccl src/misc/utils.cc getHostHash): contract-tested, not validated
    host_id_backends = ("nccl",)

    def capture_refusal(self, spec: CaptureSpec) -> str | None:
        if spec.device_type != "cuda":
            return f"rocm: cannot capture a {spec.device_type!r} region (ROCm devices are 'cuda')"
        # RCCL in hipGraphs: none declared. Not validated here, and torch's NCCL watchdog querying events during
        # a capture aborts it on ROCm 7 (hipErrorCapturedEvent; reported by SGLang, issue 29235)
        return self.collectives_refusal(spec.collectives)


plugin = RocmPlatform()
