"""Layerwise weight offload: weights live in pinned host memory and stream in ahead of use.

The first ``resident`` blocks stay on the device. The others keep their
tensors on the host; ``window`` device slots (each the size of one block's
offloaded tensors) rotate among them. While block i computes, the copies of
the next blocks run on a side stream into free slots, so the transfer hides
behind compute when a block's compute time exceeds its copy time
(bytes / host-to-device bandwidth). A slot is refilled only after the block
that used it finished (an event on the compute stream), so nothing is
overwritten while read. Which tensors of a block offload is a filter: all of
them (``layers``) or only the routed experts (``experts``).

The blocks must run in order, once per forward (decoder layers do).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

TensorFilter = Callable[[str], bool]
ALL: TensorFilter = lambda name: True  # noqa: E731
EXPERTS_ONLY: TensorFilter = lambda name: ".experts." in f".{name}"  # noqa: E731


def _tensors(block: nn.Module, keep: TensorFilter) -> list[tuple[str, torch.Tensor]]:
    named = list(block.named_parameters()) + [(n, b) for n, b in block.named_buffers() if b is not None]
    return [(n, t) for n, t in named if keep(n)]


@dataclass
class _Slot:
    tensors: dict[str, torch.Tensor]
    free: object = None  # compute-stream event: the last block using this slot is done
    ready: object = None  # copy-stream event: the block being copied in has landed
    holds: int = -1  # index of the block whose weights are (being) copied here


@dataclass
class OffloadStats:
    bytes_copied: int = 0
    copies: int = 0
    blocks: list[int] = field(default_factory=list)


class LayerOffloader:
    """Installs pre-forward hooks on ``blocks`` that page their weights in from host memory."""

    def __init__(self, blocks: list[nn.Module], services, *, resident: int = 0, window: int = 1,
                 keep: TensorFilter = ALL):
        self.services, self.window = services, max(1, window)
        self.blocks = list(blocks)
        self.offloaded = list(range(min(resident, len(blocks)), len(blocks)))
        self.stats = OffloadStats(blocks=self.offloaded)
        self.copy_stream = services.stream()
        self.host = {i: park_on_host(self.blocks[i], services, keep) for i in self.offloaded}
        self.slots = [self._new_slot(self.host[self.offloaded[0]])
                      for _ in range(min(self.window, len(self.offloaded)))]
        for pos, i in enumerate(self.offloaded):
            self.blocks[i].register_forward_pre_hook(lambda m, a, pos=pos: self._before(pos))
            self.blocks[i].register_forward_hook(lambda m, a, o, pos=pos: self._after(pos))

    # ---------------------------------------------------------------- setup
    def _new_slot(self, like: dict[str, torch.Tensor]) -> _Slot:
        dev = self.services.device
        return _Slot({n: torch.empty(t.shape, dtype=t.dtype, device=dev) for n, t in like.items()})

    # ---------------------------------------------------------------- per forward
    def _slot_of(self, pos: int) -> _Slot:
        return self.slots[pos % len(self.slots)]

    def _prefetch(self, pos: int) -> None:
        """Start copying offloaded block ``pos`` into its slot (no-op if already there)."""
        slot, block = self._slot_of(pos), self.offloaded[pos]
        if slot.holds == block:
            return
        with self.services.use_stream(self.copy_stream):
            if slot.free is not None and self.copy_stream is not None:
                self.copy_stream.wait_event(slot.free)
            for name, src in self.host[block].items():
                slot.tensors[name].copy_(src, non_blocking=True)
                self.stats.bytes_copied += src.numel() * src.element_size()
            slot.ready = self._record(self.copy_stream)
        slot.holds = block
        self.stats.copies += 1

    def _before(self, pos: int) -> None:
        self._prefetch(pos)
        slot = self._slot_of(pos)
        if slot.ready is not None:
            self.services.current_stream().wait_event(slot.ready)
        tensors = dict(_tensors(self.blocks[self.offloaded[pos]], lambda n: n in slot.tensors))
        for name, t in tensors.items():
            t.data = slot.tensors[name]
        for ahead in range(pos + 1, min(pos + len(self.slots), len(self.offloaded))):
            self._prefetch(ahead)

    def _after(self, pos: int) -> None:
        slot = self._slot_of(pos)
        slot.free = self._record(None)
        if len(self.slots) < len(self.offloaded):
            self._prefetch((pos + len(self.slots)) % len(self.offloaded))

    def _record(self, stream):
        if self.copy_stream is None:  # CPU: copies were synchronous
            return None
        ev = self.services.event()
        ev.record(stream) if stream is not None else ev.record()
        return ev

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for h in self.host.values() for t in h.values())


def park_on_host(block: nn.Module, services, keep: TensorFilter = ALL) -> dict[str, torch.Tensor]:
    """Move ``block``'s kept tensors to page-locked host memory (the module points at them meanwhile).

    Tensors parked before (a streamed build parks each layer as it is loaded)
    are adopted as they are, so ``LayerOffloader`` can take such blocks later.
    """
    host = {}
    for name, t in _tensors(block, keep):
        t.data = host[name] = services.pin(t.data)  # straight into page-locked memory; parked ones stay
    return host
