"""The AMD ROCm platform: thin hook implementations over attention/gemm/graphs.

May assume: ``torch`` imports. Importing this module does nothing else: no
device query, no vendor import, no torch flag. ROCm keeps torch's CUDA
surface (device type ``"cuda"``, ``torch.cuda``, RCCL behind the ``"nccl"``
backend, HIP graphs behind ``torch.cuda.CUDAGraph``); what differs is the
detection (``torch.version.hip``), the attention library (aiter) and the
FP8 format (fnuz on MI300-class). Detection reads the build and the device
count only; ``omni_platform_configure`` is the one hook with a process-wide
effect (``torch.cuda.set_device``).
"""
from __future__ import annotations

import torch

from omni.hookspecs import hookimpl
from omni.specs import AttentionSpec, CaptureSpec, GemmSpec, GroupedGemmSpec, PlatformInfo

from . import attention, gemm
from .capabilities import RocmCaps, detect_caps, platform_info, recipe_problems
from .graphs import GraphPools, HipGraphRunner


class RocmPlatform:
    """Hook implementations of the ``rocm`` platform (entry point ``omni.platforms: rocm``)."""

    name = "rocm"

    def __init__(self, caps: RocmCaps | None = None):
        self._caps = caps  # read lazily from the current device; tests may pass a made-up one
        self._pools = GraphPools()

    def device_caps(self) -> RocmCaps:  # a method, not a property: pluggy getattr()s every attribute
        if self._caps is None:
            self._caps = detect_caps(torch.cuda.current_device())
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
            return reject(f"rocm: cannot capture a {spec.device_type!r} region (ROCm devices are 'cuda')")
        return HipGraphRunner(spec, self._pools)

    @hookimpl
    def omni_platform_shutdown(self, info: PlatformInfo) -> None:
        self._pools.clear()


plugin = RocmPlatform()
