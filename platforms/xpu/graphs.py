"""XPU graph capture and replay for one static-shape region (``torch.xpu.XPUGraph``).

May assume: the worker's device is set and ``torch.xpu.XPUGraph`` exists
(PyTorch >= 2.11; the plugin checks). The logic mirrors the CUDA platform's
runner, on the ``torch.xpu`` module: warm-up on a side stream (lazy kernel
initialisation stays outside the capture), one capture, replay on the
current stream. Regions with the same ``CaptureSpec.pool_id`` share one
memory pool and must replay in capture order, never concurrently
(PyTorch's rule for shared pools); a pool whose graphs all died is replaced,
since the caching allocator frees it with its last graph.
"""
from __future__ import annotations

import weakref

import torch

from omni.specs import CaptureSpec


class GraphPools:
    """One memory pool per ``pool_id``, alive while any graph captured into it is alive."""

    def __init__(self):
        self._pools: dict[int, tuple[object, weakref.WeakSet]] = {}

    def handle(self, pool_id: int):
        entry = self._pools.get(pool_id)
        if entry is None or not entry[1]:
            entry = self._pools[pool_id] = (torch.xpu.graph_pool_handle(), weakref.WeakSet())
        return entry[0]

    def add(self, pool_id: int, graph) -> None:
        self._pools[pool_id][1].add(graph)

    def clear(self) -> None:
        self._pools.clear()


class XpuGraphRunner:
    """Warm ``fn`` up on a side stream, capture it once, replay it on the current stream."""

    def __init__(self, spec: CaptureSpec, pools: GraphPools | None = None, warmup: int = 2):
        self.name = f"xpu-graph[{spec.name}]"
        self.pool_id, self.pools, self.warmup = spec.pool_id, pools, warmup
        self.graph = None
        self.outputs: object = None

    def capture(self, fn) -> object:
        side = torch.xpu.Stream()
        side.wait_stream(torch.xpu.current_stream())
        with torch.xpu.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.xpu.current_stream().wait_stream(side)
        self.graph = torch.xpu.XPUGraph()
        pool = self.pools.handle(self.pool_id) if self.pools is not None else None
        with torch.xpu.graph(self.graph, pool=pool):
            self.outputs = fn()
        if self.pools is not None:
            self.pools.add(self.pool_id, self.graph)
        return self.outputs

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError(f"{self.name}: replay() before capture()")
        self.graph.replay()
