"""CUDA-graph capture and replay for one static-shape region (the ``GraphRunner`` protocol).

May assume: the worker's device is set, and ``fn`` reads and writes only
tensors whose addresses stay fixed (the engine copies new inputs into them
before ``replay()``). Regions with the same ``CaptureSpec.pool_id`` share one
memory pool; such graphs must be replayed in the order they were captured
and never concurrently (PyTorch's rule for shared pools).
"""
from __future__ import annotations

import torch

from omni.specs import CaptureSpec


class CudaGraphRunner:
    """Warm ``fn`` up on a side stream, capture it once, replay on the current stream."""

    def __init__(self, spec: CaptureSpec, pool=None, warmup: int = 2):
        self.name = f"cuda-graph[{spec.name}]"
        self.pool, self.warmup = pool, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: object = None

    def capture(self, fn) -> object:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy init, autotuning and cuBLAS workspaces happen here
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError(f"{self.name}: replay() before capture()")
        self.graph.replay()


class GraphPools:
    """One memory-pool handle per ``pool_id``, created on first use."""

    def __init__(self):
        self._pools: dict[int, object] = {}

    def get(self, pool_id: int):
        if pool_id not in self._pools:
            self._pools[pool_id] = torch.cuda.graph_pool_handle()
        return self._pools[pool_id]

    def clear(self) -> None:
        self._pools.clear()
