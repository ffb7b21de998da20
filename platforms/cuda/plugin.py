"""The NVIDIA CUDA platform: the hook implementations of ``DevicePlatform`` over this package.

May assume: ``torch`` imports. Importing this module does nothing else: no
device query, no vendor import, no torch flag. Detection reads device count
and properties only; ``omni_platform_configure`` is the one hook with a
process-wide effect (``torch.cuda.set_device``; ``TRITON_CACHE_DIR`` set under
``OMNI_KERNEL_CACHE`` where only that is set: ``triton_compile``). A server's
warm-up may first run its requests inside ``triton_compile.compiling()`` (``omni_compile_scope``). Every
factory returns a plain object the model stores, and refuses with a reason (``reject``) when a spec
does not fit, so the reference answers it and the trace says why. Regions
are captured as CUDA graphs (``torch.cuda.CUDAGraph``).
"""
from __future__ import annotations

from omni.hookspecs import hookimpl
from omni.platforms.common.graphs import GraphApi
from omni.platforms.common.plugin import DevicePlatform

from . import attention, capabilities, gemm, glue, moe
from .capabilities import triton_found
from .triton_compile import compiling, keep_binaries_with_ours


class CudaPlatform(DevicePlatform):
    """Hook implementations of the ``cuda`` platform (entry point ``omni.platforms: cuda``)."""

    name = "cuda"
    graphs = GraphApi(device_type="cuda", graph_class="CUDAGraph", label="cuda-graph")
    capabilities, attention, gemm, moe, glue = capabilities, attention, gemm, moe, glue  # what the shared hooks call
    triton_kernels = True  # gemm and moe pick Triton or torch ops from kernels.memory_bound themselves
    # gemm and moe build our CUTLASS grouped fp8 kernel (cutlass_grouped.py); the MoE runs DeepGEMM's (deepgemm_moe.py)
    grouped_fp8_kernels = ("cutlass", "deepgemm")
    # NCCL (>= 2.9.6) records its kernels into CUDA graphs; torch's ProcessGroupNCCL leaves collectives issued
    # under capture out of its watchdog and queries its events in thread-local capture mode (pytorch PRs 103503,
    # 148594), so a capture on the step's stream is not aborted. gloo blocks the host: it cannot be recorded
    capturable_collectives = ("nccl",)
    host_id_backends = ("nccl",)  # two ranks on one GPU (multi-rank tests): measured on the H200 (docs/parallel.md)

    @hookimpl
    def omni_platform_configure(self, info, local_rank: int) -> bool:
        keep_binaries_with_ours()  # before any kernel factory compiles: Triton's binaries kept beside ours
        return super().omni_platform_configure(info, local_rank)

    @hookimpl
    def omni_compile_scope(self, info):
        """``triton_compile.compiling()``: the Triton kernels' launches compile in its pool instead of running
        (the glue's router and the MoE's sort answer with the torch ops there), and leaving it builds their host
        launchers there too; None without Triton."""
        return compiling() if triton_found() else None


plugin = CudaPlatform()
