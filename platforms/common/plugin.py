"""The hook implementations every device platform writes the same way, written once.

May assume: ``torch`` only; importing this module does nothing else (no device
query, no vendor import, no torch flag). A vendor's plugin class derives from
``DevicePlatform`` and names its parts; everything vendor-specific stays in
the vendor's package, in modules of one shape:

    capabilities  ``platform_info(reject)``: cheap detection (no device context);
                  ``detect_caps(index)``: the capability snapshot, read on a
                  worker whose device is set; ``recipe_problems(recipe)``: the
                  static refusals of a recipe, as reasons.
    attention     ``resolve(spec, caps, reject)``.
    gemm          ``resolve_linear(spec, caps, reject)``, ``resolve_grouped(spec, caps, reject)``.
    moe           optional: ``resolve_moe(spec, caps, reject)``, a fused MoE; without it
                  ``omni_moe_impl`` composes the platform's grouped GEMMs (``omni.moe.ComposedMoE``).
    glue          optional: ``resolve_glue(spec, caps, reject)``, the fused norms / RoPE / SwiGLU /
                  routing between the GEMMs; without it the reference's torch ops answer.

``omni.platform_parts`` states these shapes as typed Protocols (one per module).

``torch.<device_type>`` is read inside hooks only (``set_device``,
``current_device``, graphs). ``omni_platform_configure`` is the one hook with
a process-wide effect. A subclass that overrides a hook marks it
``@hookimpl`` again; ``graphs_missing`` is the place for a build without
the device's graph class.
"""
from __future__ import annotations

import socket

from omni.hookspecs import hookimpl
from omni.moe import composed_moe
from omni.platform_parts import AttentionModule, CapabilitiesModule, GemmModule, GlueModule, MoEModule
from omni.specs import AttentionSpec, CaptureSpec, GemmSpec, GlueSpec, GroupedGemmSpec, MoESpec, PlatformInfo

from .graphs import DeviceGraphRunner, GraphApi, GraphPools


class DevicePlatform:
    """Hook implementations shared by the device platforms; a subclass sets the class attributes."""

    name: str  # the platform's name and the prefix of its refusal reasons
    # torch.distributed backends whose collectives record into this device's graphs (a step graph with a
    # tensor-parallel all-reduce inside); a platform lists one only where its vendor documents graph capture
    capturable_collectives: tuple[str, ...] = ()
    graphs: GraphApi  # its device module (``torch.<graphs.device_type>``) and graph class
    capabilities: CapabilitiesModule
    attention: AttentionModule
    gemm: GemmModule
    moe: MoEModule | None = None
    glue: GlueModule | None = None
    triton_kernels: bool = False  # its gemm/moe modules honour kernels.memory_bound=triton themselves
    grouped_fp8_kernels: tuple[str, ...] = ()  # kernels.grouped_fp8 demands (beyond auto, torch) its gemm/moe meet
    # torch.distributed backends whose library takes its host id from NCCL_HOSTID: NCCL and its fork RCCL refuse
    # two ranks on one device of one host ("Duplicate GPU detected": they compare host hashes and bus ids) unless
    # each rank names a host of its own, and then join the ranks over their socket transport
    host_id_backends: tuple[str, ...] = ()

    def __init__(self, caps=None):
        self._caps = caps  # read lazily from the current device; tests may pass a made-up one
        self._pools = GraphPools(self.graphs)

    def device_module(self):  # torch.<device_type>, looked up when a hook runs
        return self.graphs.module()

    def device_caps(self):  # a method, not a property: pluggy getattr()s every attribute
        if self._caps is None:
            self._caps = self.capabilities.detect_caps(self.device_module().current_device())
        return self._caps

    def capture_refusal(self, spec: CaptureSpec) -> str | None:
        """Why the region of ``spec`` cannot be captured here; None when it can."""
        if spec.device_type != self.graphs.device_type:
            return f"{self.name}: cannot capture a {spec.device_type!r} region"
        return self.graphs_missing() or self.collectives_refusal(spec.collectives)

    def collectives_refusal(self, backend: str) -> str | None:
        """Why collectives of ``backend`` cannot be recorded into this device's graphs; None when they can
        (``capturable_collectives``)."""
        if not backend or backend in self.capturable_collectives:
            return None
        known = ", ".join(self.capturable_collectives) or "none"
        return (f"{self.name}: {backend!r} collectives cannot be recorded into a device graph "
                f"(recordable here: {known}); use graph.mode=eager")

    def graphs_missing(self) -> str | None:
        """Why this device cannot capture at all (no graph class in this build); None when it can."""
        return None

    @hookimpl
    def omni_platform_detect(self, reject) -> PlatformInfo | None:
        return self.capabilities.platform_info(reject)

    @hookimpl
    def omni_check_recipe(self, recipe, info: PlatformInfo, reject) -> None:
        for problem in self.capabilities.recipe_problems(recipe):
            reject(problem)

    @hookimpl
    def omni_shared_device_env(self, info, rank: int, backend: str) -> dict | None:
        if backend not in self.host_id_backends:
            return None  # the reference's answer: nothing to set
        return {"NCCL_HOSTID": f"{socket.gethostname()}-omni-rank{rank}"}

    @hookimpl
    def omni_platform_configure(self, info: PlatformInfo, local_rank: int) -> bool:
        self.device_module().set_device(local_rank)
        return True

    @hookimpl
    def omni_attention_impl(self, spec: AttentionSpec, reject):
        return self.attention.resolve(spec, self.device_caps(), reject)

    def triton_refusal(self, spec: GemmSpec | MoESpec) -> str | None:
        """A ``kernels.memory_bound=triton`` demand this platform's kernels cannot meet (None: no demand, or met)."""
        if spec.memory_bound != "triton" or self.triton_kernels:
            return None
        return f"{self.name}: kernels.memory_bound=triton, but this platform has no Triton kernels (use auto or torch)"

    def grouped_refusal(self, spec: GroupedGemmSpec | MoESpec) -> str | None:
        """A ``kernels.grouped_fp8`` demand for quantized experts this platform cannot meet (None: none, or met)."""
        if spec.quant == "none" or spec.grouped_fp8 in ("auto", "torch", *self.grouped_fp8_kernels):
            return None
        return (f"{self.name}: kernels.grouped_fp8={spec.grouped_fp8}, but this platform has no such kernel "
                f"(use auto or torch)")

    @hookimpl
    def omni_linear_impl(self, spec: GemmSpec, reject):
        refusal = self.triton_refusal(spec)
        if refusal is not None:
            return reject(refusal)
        return self.gemm.resolve_linear(spec, self.device_caps(), reject)

    @hookimpl
    def omni_grouped_gemm_impl(self, spec: GroupedGemmSpec, reject):
        refusal = self.grouped_refusal(spec)
        if refusal is not None:
            return reject(refusal)
        return self.gemm.resolve_grouped(spec, self.device_caps(), reject)

    @hookimpl
    def omni_moe_impl(self, spec: MoESpec, reject):
        refusal = self.triton_refusal(spec) or self.grouped_refusal(spec)
        if refusal is not None:
            return reject(refusal)
        if self.moe is not None:
            return self.moe.resolve_moe(spec, self.device_caps(), reject)
        return composed_moe(spec, lambda g, r: self.gemm.resolve_grouped(g, self.device_caps(), r), reject)

    @hookimpl
    def omni_glue_impl(self, spec: GlueSpec, reject):
        if self.glue is None:
            return None  # the reference's torch ops run on this device
        return self.glue.resolve_glue(spec, self.device_caps(), reject)

    @hookimpl
    def omni_graph_runner_impl(self, spec: CaptureSpec, reject):
        refusal = self.capture_refusal(spec)
        if refusal is not None:
            return reject(refusal)
        return DeviceGraphRunner(spec, self.graphs, self._pools)

    @hookimpl
    def omni_platform_shutdown(self, info: PlatformInfo) -> None:
        self._pools.clear()
