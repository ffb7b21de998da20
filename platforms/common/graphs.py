"""Device-graph capture and replay for one static-shape region (the ``GraphRunner`` protocol).

May assume: ``torch`` only. A ``GraphApi`` names the device's module and graph
class: ``torch.cuda.CUDAGraph`` (hipGraphs on a ROCm build),
``torch.npu.NPUGraph``, ``torch.xpu.XPUGraph``, ``torch.musa.MUSAGraph``.
They are looked up when a region is captured, never at import:
``torch.npu`` and ``torch.musa`` exist only once the vendor's torch extension
is loaded. Each of those modules offers the same stream API (``Stream``,
``current_stream``, ``stream``) and ``graph(g, pool=...)`` /
``graph_pool_handle()``, which is all the runner uses.

The worker's device is set, and ``fn`` reads and writes only tensors whose
addresses stay fixed (the engine copies new inputs into them before
``replay()``). Regions with the same ``CaptureSpec.pool_id`` share one memory
pool; such graphs must be replayed in the order they were captured and never
concurrently (PyTorch's rule for shared pools).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from omni.specs import CaptureSpec


@dataclass(frozen=True)
class GraphApi:
    """Where a device keeps its graphs: ``torch.<device_type>.<graph_class>``."""

    device_type: str  # "cuda", "npu", "xpu", "musa"
    graph_class: str  # "CUDAGraph", "NPUGraph", "XPUGraph", "MUSAGraph"
    label: str  # names runners "<label>[<region>]", so traces say which graph kind ran: "hip-graph"

    def module(self):
        return getattr(torch, self.device_type)


class GraphPools:
    """One memory pool per ``pool_id``, alive while any graph captured into it is alive.

    The caching allocator frees a graph pool when its last graph dies; a handle
    kept past that point is stale (capturing into it trips an allocator assert),
    so a pool whose graphs are all gone is replaced by a fresh handle.
    """

    def __init__(self, api: GraphApi):
        self.api = api
        self._pools: dict[int, tuple[object, weakref.WeakSet]] = {}

    def handle(self, pool_id: int):
        entry = self._pools.get(pool_id)
        if entry is None or not entry[1]:
            entry = self._pools[pool_id] = (self.api.module().graph_pool_handle(), weakref.WeakSet())
        return entry[0]

    def add(self, pool_id: int, graph) -> None:
        self._pools[pool_id][1].add(graph)

    def clear(self) -> None:
        self._pools.clear()


class DeviceGraphRunner:
    """Warm ``fn`` up on a side stream, capture it once, replay it on the current stream."""

    def __init__(self, spec: CaptureSpec, api: GraphApi, pools: GraphPools | None = None, warmup: int = 2):
        self.name = f"{api.label}[{spec.name}]"
        self.api, self.pool_id, self.pools, self.warmup = api, spec.pool_id, pools, warmup
        self.graph = None
        self.outputs: object = None

    def capture(self, fn) -> object:
        device = self.api.module()
        side = device.Stream()
        side.wait_stream(device.current_stream())
        with device.stream(side):  # lazy init, autotuning and library workspaces happen here, not in the graph
            for _ in range(self.warmup):
                fn()
        device.current_stream().wait_stream(side)
        self.graph = getattr(device, self.api.graph_class)()
        pool = self.pools.handle(self.pool_id) if self.pools is not None else None
        with device.graph(self.graph, pool=pool):
            self.outputs = fn()
        if self.pools is not None:
            self.pools.add(self.pool_id, self.graph)
        return self.outputs

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError(f"{self.name}: replay() before capture()")
        self.graph.replay()
