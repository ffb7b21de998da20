"""HIP graphs: ``torch.cuda.CUDAGraph`` on a ROCm build records hipGraphs.

May assume: the worker's device is set. The capture/replay logic and the
pool lifetime rules are the CUDA platform's (the same torch API on ROCm);
only the name differs, so traces say which graph kind ran.
"""
from __future__ import annotations

from omni.platforms.cuda.graphs import CudaGraphRunner, GraphPools
from omni.specs import CaptureSpec

__all__ = ["GraphPools", "HipGraphRunner"]


class HipGraphRunner(CudaGraphRunner):
    def __init__(self, spec: CaptureSpec, pools: GraphPools | None = None, warmup: int = 2):
        super().__init__(spec, pools, warmup=warmup)
        self.name = f"hip-graph[{spec.name}]"
