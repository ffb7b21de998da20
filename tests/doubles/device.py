"""Fake device state: the ``torch.<device>`` surface a platform touches, recorded.

``FakeDevice`` stands in for ``torch.npu`` / ``torch.musa`` (new modules),
``torch.xpu`` and ROCm's ``torch.cuda`` (attributes patched in place). Every
call is appended to ``calls``; ``context_calls()`` lists those that would
create or use a device context on real hardware (everything but
``is_available`` and ``device_count``), which detection must never make.
Graphs record capture and replay; streams are no-ops that record waits.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
import types
from dataclasses import dataclass

CHEAP = ("is_available", "device_count")


@dataclass(frozen=True)
class FakeProps:
    name: str
    total_memory: int = 64 << 30
    gcnArchName: str = ""  # ROCm only


class FakeStream:
    def __init__(self, device: "FakeDevice"):
        self.device = device

    def wait_stream(self, other) -> None:
        self.device.record("Stream.wait_stream")


class FakeGraph:
    def __init__(self, device: "FakeDevice"):
        self.device, self.captured, self.replays = device, False, 0

    def replay(self) -> None:
        self.device.record("Graph.replay")
        self.replays += 1


class FakeDevice:
    def __init__(self, *, count: int = 8, name: str = "", capability=(0, 0), graph_class: str | None = None,
                 arch: str = ""):
        self.count, self.name, self.capability, self.graph_class = count, name, tuple(capability), graph_class
        self.props = FakeProps(name=name, gcnArchName=arch)
        self.calls: list[str] = []
        self.current, self.capturing = 0, False
        self.pools: list[object] = []
        self.graphs: list[FakeGraph] = []

    def record(self, name: str) -> None:
        self.calls.append(name)

    def context_calls(self) -> list[str]:
        return [c for c in self.calls if c not in CHEAP]

    # -- the torch.<device> surface
    def is_available(self) -> bool:
        self.record("is_available")
        return self.count > 0

    def device_count(self) -> int:
        self.record("device_count")
        return self.count

    def current_device(self) -> int:
        self.record("current_device")
        return self.current

    def set_device(self, index: int) -> None:
        self.record("set_device")
        self.current = index

    def get_device_name(self, index: int = 0) -> str:
        self.record("get_device_name")
        return self.name

    def get_device_properties(self, index: int = 0) -> FakeProps:
        self.record("get_device_properties")
        return self.props

    def get_device_capability(self, index: int = 0) -> tuple[int, int]:
        self.record("get_device_capability")
        return self.capability

    def Stream(self, *args, **kwargs) -> FakeStream:  # noqa: N802 (torch's name)
        self.record("Stream")
        return FakeStream(self)

    def current_stream(self, *args) -> FakeStream:
        self.record("current_stream")
        return FakeStream(self)

    @contextlib.contextmanager
    def stream(self, s):
        self.record("stream")
        yield s

    def synchronize(self, *args) -> None:
        self.record("synchronize")

    def graph_pool_handle(self) -> tuple:
        self.record("graph_pool_handle")
        return ("pool", len(self.calls))

    def new_graph(self) -> FakeGraph:
        self.record("Graph")
        g = FakeGraph(self)
        self.graphs.append(g)
        return g

    @contextlib.contextmanager
    def graph(self, g: FakeGraph, pool=None, stream=None, **kwargs):
        self.record("graph")
        self.pools.append(pool)
        self.capturing = True
        try:
            yield g
        finally:
            self.capturing, g.captured = False, True

    API = ("is_available", "device_count", "current_device", "set_device", "get_device_name",
           "get_device_properties", "get_device_capability", "Stream", "current_stream", "stream",
           "synchronize", "graph_pool_handle", "graph")

    def surface(self) -> dict[str, object]:
        names = {name: getattr(self, name) for name in self.API}
        if self.graph_class:
            names[self.graph_class] = self.new_graph
        return names

    def install(self, monkeypatch, target) -> None:
        """Patch the surface onto an existing module (torch.cuda, torch.xpu)."""
        for name, value in self.surface().items():
            monkeypatch.setattr(target, name, value, raising=False)

    def as_module(self, name: str) -> types.ModuleType:
        """A new module carrying the surface (torch.npu, torch.musa)."""
        module = types.ModuleType(name)
        module.__dict__.update(self.surface())
        return module


def vendor_module(name: str, **attrs) -> types.ModuleType:
    """A module object that ``find_spec`` and ``import_module`` accept once it is in ``sys.modules``."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None)
    module.__dict__.update(attrs)
    return module


class _BrokenFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``name`` look installed to ``find_spec`` while importing it raises ``error``."""

    def __init__(self, name: str, error: BaseException):
        self.name, self.error = name, error

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


def install_broken(monkeypatch, name: str, error: BaseException) -> None:
    """``name`` is installed but fails to import (e.g. torch_npu without CANN: libhccl.so missing)."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenFinder(name, error), *sys.meta_path])
