"""The Moore Threads (MUSA) platform: thin hook implementations over attention/graphs.

May assume: ``torch`` imports. Importing this module imports nothing else:
torch_musa is loaded by detection (see capabilities.py). Collectives use
MCCL (backend ``"mccl"``, registered by torch_musa); GEMMs are declined (the
reference's ``F.linear`` and expert loop serve them; torch_musa's FP8
``_scaled_mm`` needs arch >= 3.1 and is not wired yet). ``omni_platform_configure``
is the one hook with a process-wide effect (``torch.musa.set_device``).
"""
from __future__ import annotations

import torch

from omni.hookspecs import hookimpl
from omni.specs import AttentionSpec, CaptureSpec, GemmSpec, GroupedGemmSpec, PlatformInfo

from . import attention
from .capabilities import MusaCaps, detect_caps, platform_info, recipe_problems
from .graphs import GraphPools, MusaGraphRunner


class MusaPlatform:
    """Hook implementations of the ``musa`` platform (entry point ``omni.platforms: musa``)."""

    name = "musa"

    def __init__(self, caps: MusaCaps | None = None):
        self._caps = caps  # read lazily from the current device; tests may pass a made-up one
        self._pools = GraphPools()

    def device_caps(self) -> MusaCaps:  # a method, not a property: pluggy getattr()s every attribute
        if self._caps is None:
            self._caps = detect_caps(torch.musa.current_device())
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
        torch.musa.set_device(local_rank)
        return True

    @hookimpl
    def omni_attention_impl(self, spec: AttentionSpec, reject):
        return attention.resolve(spec, self.device_caps(), reject)

    @hookimpl
    def omni_linear_impl(self, spec: GemmSpec, reject):
        if spec.quant == "none":
            return reject("musa: unquantized linears are F.linear (muBLAS); the reference serves them")
        return reject(f"musa: quant {spec.quant!r} lands later (torch_musa's FP8 _scaled_mm needs MUSA arch >= 3.1)")

    @hookimpl
    def omni_grouped_gemm_impl(self, spec: GroupedGemmSpec, reject):
        return reject("musa: torch_musa has no grouped GEMM (_grouped_mm); the reference expert loop serves it")

    @hookimpl
    def omni_graph_runner_impl(self, spec: CaptureSpec, reject):
        if spec.device_type != "musa":
            return reject(f"musa: cannot capture a {spec.device_type!r} region")
        if not self.device_caps().graphs:
            return reject("musa: torch.musa.MUSAGraph is missing in this torch_musa")
        return MusaGraphRunner(spec, self._pools)

    @hookimpl
    def omni_platform_shutdown(self, info: PlatformInfo) -> None:
        self._pools.clear()


plugin = MusaPlatform()
