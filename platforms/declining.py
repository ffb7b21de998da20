"""A platform that is installed but not implemented yet: it detects, then declines.

Used by rocm, npu, xpu and musa until their kernels land, so that
``omni-run platforms`` lists them honestly and any spec resolves to a clear
"not implemented yet" reason instead of pretending.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from omni.hookspecs import hookimpl
from omni.specs import PlatformInfo

NOT_YET = "not implemented yet"


@dataclass(frozen=True)
class DecliningPlatform:
    name: str
    device_type: str
    dist_backend: str
    vendor_module: str  # probed with find_spec only: importing may have side effects

    def _decline(self, reject):
        reject(f"{self.name}: {NOT_YET}")

    @hookimpl
    def omni_platform_detect(self, reject):
        present = importlib.util.find_spec(self.vendor_module) is not None
        reject(f"{self.name}: {NOT_YET} ({self.vendor_module} {'installed' if present else 'not installed'})")

    @hookimpl
    def omni_attention_impl(self, spec, reject):
        self._decline(reject)

    @hookimpl
    def omni_linear_impl(self, spec, reject):
        self._decline(reject)

    @hookimpl
    def omni_grouped_gemm_impl(self, spec, reject):
        self._decline(reject)

    @hookimpl
    def omni_graph_runner_impl(self, spec, reject):
        self._decline(reject)
