"""The NVIDIA CUDA platform: thin hook implementations over attention/gemm/graphs.

May assume: ``torch`` imports. Importing this module does nothing else: no
device query, no vendor import, no torch flag. Detection reads device count
and properties only; ``omni_platform_configure`` is the one hook with a
process-wide effect (``torch.cuda.set_device``). Every factory returns a plain
object the model stores, and refuses with a reason (``reject``) when a spec
does not fit, so the reference answers it and the trace says why.
"""
from __future__ import annotations

import torch

from omni.hookspecs import hookimpl
from omni.specs import AttentionSpec, CaptureSpec, GemmSpec, GroupedGemmSpec, PlatformInfo

from . import attention, gemm
from .capabilities import Caps, detect_caps, platform_info
from .graphs import CudaGraphRunner, GraphPools


class CudaPlatform:
    """Hook implementations of the ``cuda`` platform (entry point ``omni.platforms: cuda``)."""

    name = "cuda"

    def __init__(self, caps: Caps | None = None):
        self._caps = caps  # read lazily from the current device; tests may pass a made-up one
        self._pools = GraphPools()

    def device_caps(self) -> Caps:  # a method, not a property: pluggy getattr()s every attribute
        if self._caps is None:
            self._caps = detect_caps(torch.cuda.current_device())
        return self._caps

    @hookimpl
    def omni_platform_detect(self, reject) -> PlatformInfo | None:
        return platform_info(reject)

    @hookimpl
    def omni_platform_configure(self, info: PlatformInfo, local_rank: int) -> bool:
        torch.cuda.set_device(local_rank)
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
        if spec.device_type != "cuda":
            return reject(f"cuda: cannot capture a {spec.device_type!r} region")
        return CudaGraphRunner(spec, self._pools)

    @hookimpl
    def omni_platform_shutdown(self, info: PlatformInfo) -> None:
        self._pools.clear()


plugin = CudaPlatform()
