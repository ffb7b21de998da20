"""Device services behind one small object (streams, events, memory, sync).

Built by the platform's ``omni_device_services`` hook once per worker; core
code asks this object instead of calling ``torch.<vendor>`` directly.
``torch.accelerator`` covers most of it on every vendor that registers a
device module, so one class serves cuda, xpu, npu and musa alike.
"""
from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set: Linux's ``VmHWM``, which starts afresh with the process image. Not
    ``ru_maxrss``: that survives fork and exec, so a spawned rank would report its launcher's peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # no procfs (macOS reports ru_maxrss in bytes, Linux in KiB)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if os.uname().sysname == "Darwin" else maxrss * 1024


def upload(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a list or a host tensor) on ``device``, queued without waiting: staged in page-locked memory and
    copied asynchronously. A plain copy from pageable memory (``torch.tensor(data, device=...)``) makes the host
    wait until every kernel queued before it has run (a blocking copy synchronizes the stream), which stalls a
    host that prepares the next step while the device runs the last one. The staging buffer comes from torch's
    page-locked cache, which does not hand it out again before the copy has run."""
    t = torch.as_tensor(data, dtype=dtype)
    device = torch.device(device)
    if t.device.type != "cpu" or device.type == "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class DeviceServices:
    """Services for one device of type ``device_type`` (``index`` on this host)."""

    device_type: str
    index: int = 0

    @property
    def device(self) -> torch.device:
        return (torch.device(self.device_type) if self.device_type == "cpu"
                else torch.device(self.device_type, self.index))

    @property
    def _mod(self):  # the torch.<device_type> module; present for every registered backend
        return getattr(torch, self.device_type)

    def synchronize(self) -> None:
        if self.device_type != "cpu":
            self._mod.synchronize(self.device)

    def stream(self, priority: int = 0):
        """A new stream of this device (None on the CPU); ``priority`` as ``torch.<device>.Stream`` takes it."""
        return self._mod.Stream(self.device, priority=priority) if self.device_type != "cpu" else None

    def current_stream(self):
        return self._mod.current_stream(self.device) if self.device_type != "cpu" else None

    def use_stream(self, stream):
        return self._mod.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(self, enable_timing: bool = False):
        return self._mod.Event(enable_timing=enable_timing) if self.device_type != "cpu" else None

    def max_memory_allocated(self) -> int:
        if self.device_type == "cpu":
            return peak_rss_bytes()
        return self._mod.max_memory_allocated(self.device)

    def reset_peak_memory(self) -> None:
        if self.device_type != "cpu":
            self._mod.reset_peak_memory_stats(self.device)

    def memory_stats(self) -> dict:
        if self.device_type == "cpu":
            return {"peak_bytes": self.max_memory_allocated()}
        return {"allocated_bytes": self._mod.memory_allocated(self.device),
                "reserved_bytes": self._mod.memory_reserved(self.device),
                "peak_bytes": self._mod.max_memory_allocated(self.device)}

    def limit_memory(self, limit_bytes: int) -> float:
        """Cap this process's allocator at ``limit_bytes`` (beyond it allocations fail); returns the fraction set."""
        setter = getattr(self._mod, "set_per_process_memory_fraction", None)
        if self.device_type == "cpu" or setter is None:
            raise RuntimeError(f"device.memory_limit_gib: torch.{self.device_type} cannot cap its memory "
                               "(no set_per_process_memory_fraction); set device.memory_limit_gib: 0")
        total = self._mod.get_device_properties(self.device).total_memory
        fraction = min(1.0, limit_bytes / total)
        setter(fraction, self.device)
        return fraction

    def expandable_segments(self) -> str:
        """Have the caching allocator grow its segments in place (torch's ``expandable_segments``) from here on,
        so that memory freed by one phase can serve the next phase's larger blocks instead of staying reserved
        beside new segments. Returns what was done, for the log: set, left to the environment's allocator
        settings (``PYTORCH_ALLOC_CONF`` / ``PYTORCH_<DEVICE>_ALLOC_CONF`` name it already: the operator's word
        wins), or nothing to do on the CPU. Segments reserved before the call keep their kind."""
        if self.device_type == "cpu":
            return "no caching allocator on the cpu"
        for var in ("PYTORCH_ALLOC_CONF", f"PYTORCH_{self.device_type.upper()}_ALLOC_CONF"):
            if "expandable_segments" in os.environ.get(var, ""):
                return f"left to {var}={os.environ[var]}"
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9, every accelerator
        if setter is None:  # an older torch: the device module's own (torch.cuda's since torch 2.1)
            setter = getattr(getattr(self._mod, "memory", None), "_set_allocator_settings", None)
        if setter is None:
            raise RuntimeError(f"device.expandable_segments: torch {torch.__version__} cannot set the "
                               f"{self.device_type} allocator at run time; set it false")
        setter("expandable_segments:True")
        return "set"

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in page-locked host memory: allocated once and filled by one copy, or ``t`` if it is already there
        (on the CPU platform: host memory, pinned or not)."""
        if self.device_type == "cpu" or (t.device.type == "cpu" and t.is_pinned()):
            return t.to("cpu")
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t)

    def to_host_async(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """``t`` copied into page-locked host memory behind the work queued so far, without waiting: (the host
        tensor, an event to ``synchronize`` before reading it). On the CPU platform the copy is made at once
        (event None)."""
        if self.device_type == "cpu":
            return t.clone(), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ready = self.event()
        ready.record(self.current_stream())
        return host, ready

    def empty_cache(self) -> None:
        if self.device_type != "cpu":
            self._mod.empty_cache()
