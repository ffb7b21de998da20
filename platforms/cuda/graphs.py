"""CUDA-graph capture and replay for one static-shape region (the ``GraphRunner`` protocol).

May assume: the worker's device is set, and ``fn`` reads and writes only
tensors whose addresses stay fixed (the engine copies new inputs into them
before ``replay()``). Regions with the same ``CaptureSpec.pool_id`` share one
memory pool; such graphs must be replayed in the order they were captured
and never concurrently (PyTorch's rule for shared pools).
"""
from __future__ import annotations

import weakref

import torch

from omni.specs import CaptureSpec


class CudaGraphRunner:
    """Warm ``fn`` up on a side stream, capture it once, replay on the current stream."""

    def __init__(self, spec: CaptureSpec, pools: "GraphPools | None" = None, warmup: int = 2):
        self.name = f"cuda-graph[{spec.name}]"
        self.pool_id, self.pools, self.warmup = spec.pool_id, pools, warmup
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
        pool = self.pools.handle(self.pool_id) if self.pools is not None else None
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn()
        if self.pools is not None:
            self.pools.add(self.pool_id, self.graph)
        return self.outputs

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError(f"{self.name}: replay() before capture()")
        self.graph.replay()


class GraphPools:
    """One memory pool per ``pool_id``, alive while any graph captured into it is alive.

    The caching allocator frees a graph pool when its last graph dies; a handle
    kept past that point is stale (capturing into it trips an allocator assert),
    so a pool whose graphs are all gone is replaced by a fresh handle.
    """

    def __init__(self):
        self._pools: dict[int, tuple[object, weakref.WeakSet]] = {}

    def handle(self, pool_id: int):
        entry = self._pools.get(pool_id)
        if entry is None or not entry[1]:
            entry = self._pools[pool_id] = (torch.cuda.graph_pool_handle(), weakref.WeakSet())
        return entry[0]

    def add(self, pool_id: int, graph) -> None:
        self._pools[pool_id][1].add(graph)

    def clear(self) -> None:
        self._pools.clear()
