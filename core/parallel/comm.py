"""Collectives of one mesh axis, the only place core calls ``torch.distributed`` ops.

A ``Comm`` wraps one process group. It uses the platform's communicator
(``omni_communicator_impl``) when the platform returns one and plain
``torch.distributed`` otherwise. A Comm of size 1 returns its input, so
single-device code paths run the same functions.

``CommStats`` (benchmarks) adds up the time spent inside collectives: device
events around each call where the device has them (the sum of collective
kernel times, waiting for peers included), the host clock on the CPU.
``enabled=False`` (benchmarks only: the "comm-free variant") skips the
exchanges while keeping shapes, so the results are wrong but the compute
time is what it would be without communication.
"""
from __future__ import annotations

import contextlib
import time

import torch

from omni.specs import CollectiveSpec


class CommStats:
    """Accumulates seconds spent in collectives; ``collect()`` synchronises and returns them."""

    def __init__(self, services=None):
        self.services, self.enabled = services, True
        self._events: list = []
        self._host_s, self.calls = 0.0, 0

    @contextlib.contextmanager
    def timed(self):
        start = self.services.event(enable_timing=True) if self.services is not None else None
        if start is None:
            t0 = time.perf_counter()
            yield
            self._host_s += time.perf_counter() - t0
        else:
            end = self.services.event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        self.calls += 1

    def collect(self) -> float:
        """Seconds in collectives since the last collect (synchronises the device)."""
        if self.services is not None:
            self.services.synchronize()
        total = self._host_s + sum(s.elapsed_time(e) for s, e in self._events) / 1000.0
        self._events, self._host_s = [], 0.0
        return total


class Comm:
    """Collectives over the ranks ``ranks`` (global ranks, sorted); ``rank`` is this rank's index among them."""

    def __init__(self, axis: str, group, ranks: list[int], global_rank: int, impl=None, stats: CommStats | None = None):
        self.axis, self.group, self.ranks = axis, group, list(ranks)
        self.size, self.rank = len(ranks), ranks.index(global_rank)
        self.impl, self.stats, self.enabled = impl, stats, True

    @classmethod
    def create(cls, axis: str, group, ranks: list[int], global_rank: int, *, platform=None,
               device_type: str = "cpu", stats: CommStats | None = None) -> "Comm":
        impl = None
        if platform is not None and len(ranks) > 1:
            spec = CollectiveSpec(axis=axis, world_size=len(ranks), device_type=device_type)
            impl = platform.communicator(spec, group)
        return cls(axis, group, ranks, global_rank, impl, stats)

    @classmethod
    def trivial(cls, axis: str, global_rank: int) -> "Comm":
        return cls(axis, None, [global_rank], global_rank)

    def __repr__(self) -> str:
        return f"Comm({self.axis}, ranks {self.ranks}, index {self.rank})"

    @property
    def active(self) -> bool:
        return self.size > 1 and self.enabled

    @property
    def backend(self) -> str:
        """The torch.distributed backend of this group ("nccl", "gloo"...); "" for a group of one."""
        if self.size == 1:
            return ""
        import torch.distributed as dist

        return str(dist.get_backend(self.group))

    def _timed(self):
        return self.stats.timed() if self.stats is not None and self.stats.enabled else contextlib.nullcontext()

    # ------------------------------------------------------------------ tensor collectives

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns ``t``."""
        if not self.active:
            return t
        import torch.distributed as dist

        with self._timed():
            if self.impl is not None:
                out = self.impl.all_reduce(t)
                if out is not None and out is not t:
                    t.copy_(out)
            else:
                dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Equal-shaped ``t`` from every rank stacked along a new dim 0: ``[size, *t.shape]``."""
        if self.size == 1:
            return t[None]
        if not self.enabled:
            return t[None].expand(self.size, *t.shape).clone()
        import torch.distributed as dist

        t = t.contiguous()
        with self._timed():
            if self.impl is not None:
                return self.impl.all_gather(t[None], 0)
            flat = t.reshape(-1)
            out = flat.new_empty(self.size * flat.numel())  # concatenated along dim 0 (gloo and NCCL agree)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.10
            gather(out, flat, group=self.group)
        return out.view(self.size, *t.shape)

    def all_gather_rows(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate along dim 0 the ``sizes[i]`` rows each rank holds (uneven allowed)."""
        if self.size == 1:
            return t
        pad = max(sizes)
        padded = t if t.shape[0] == pad else torch.cat([t, t.new_zeros(pad - t.shape[0], *t.shape[1:])])
        stacked = self.all_gather(padded)
        return torch.cat([stacked[i, :n] for i, n in enumerate(sizes)])

    def all_to_all(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        """Rows ``in_splits[j]`` of ``t`` go to rank j; returns the rows received, in rank order."""
        if self.size == 1:
            return t
        if not self.enabled:
            raise RuntimeError(f"{self}: all_to_all has no comm-free variant (shapes depend on the exchange)")
        import torch.distributed as dist

        t = t.contiguous()
        with self._timed():
            if self.impl is not None:
                return self.impl.all_to_all(t, list(in_splits), list(out_splits))
            out = t.new_empty(sum(out_splits), *t.shape[1:])
            dist.all_to_all_single(out, t, list(out_splits), list(in_splits), group=self.group)
        return out

    def shift(self, t: torch.Tensor, recv_rows: int):
        """Start sending ``t`` to the next rank and receiving ``recv_rows`` rows from the previous one.

        Returns ``(recv, wait)``: call ``wait()`` before reading ``recv`` (the
        transfer overlaps whatever runs in between).
        """
        import torch.distributed as dist

        t = t.contiguous()
        recv = t.new_empty(recv_rows, *t.shape[1:])
        nxt, prev = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        ops = [dist.P2POp(dist.isend, t, nxt, group=self.group), dist.P2POp(dist.irecv, recv, prev, group=self.group)]
        cm = self._timed()
        cm.__enter__()
        works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for w in works:
                w.wait()
            cm.__exit__(None, None, None)
            return recv

        return recv, wait

    # ------------------------------------------------------------------ host objects

    def broadcast_object(self, obj=None, src: int = 0):
        """``obj`` of group index ``src`` on every rank (pickled; for small control messages)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out
