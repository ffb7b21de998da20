"""Graph capture of the denoising step's backbone (recipe ``graph.mode: capture``).

A denoising step of a fixed active set does the same work on new numbers:
the packed image-block embeddings change, while the rope tables, the varlen
metadata and the KV slots depend only on the rows. So the backbone is
captured once per *batch signature* (the tuple of the active rows'
``(prefix_len, token_h, token_w)``) through the platform's graph hook
(``Platform.graph_runner``), into a static input buffer, and replayed while
the signature holds:

    key = step_key(states)               # (signature, binding)
    h_TD = graphs.run(key, x_TD, model.backbone, lambda: (cos, sin, ctx))

``make_args()`` builds the constant arguments (device tables, the attention
context) outside the capture. When the same signature comes back with other
KV pages (another request set of the same shapes: the *binding* changed),
the new slot tables are copied into the captured ones in place (same shapes
by construction) and the graph is replayed, not re-captured. Graphs are kept
LRU (``max_graphs``). With ``key_bucket`` (attention kernels that read
sequence lengths on the device only), prompts of other lengths share a graph:
the key tables are padded to a bucket of key lengths (``step_key``), so a
serving process captures a handful of graphs, not one per request.

Memory: all graphs of one ``StepGraphs`` share ONE memory pool, so the
captures of many signatures cost about one step's working set, not one per
signature (a pool per graph grew reserved memory by ~2 GiB per request at
the released shapes). Sharing is safe because replays never overlap and a
replay's output is consumed before the next replay of any graph of the
object: the output is valid until then (callers copy what they keep).

Rules the captured region obeys (checked by the GPU test, capture == eager):
no host sync, no allocation by value; every kernel the model resolved must be
capturable (attention specs are built with ``capturable=True`` under this
recipe, which the reference platform refuses). Under tensor parallelism the region also
records the step's all-reduces: ``collectives`` names their backend, which
the platform must be able to record (``CaptureSpec.collectives``), and every
rank captures and replays the same signatures in the same order (the replica
runs in lock-step). A platform without graphs
refuses at construction: ``strict`` raises with the platform's reasons (the
recipe path: startup fails), otherwise the object runs eagerly and keeps the
reason in ``refusal`` (logged once).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from . import compile_pass
from .platform_manager import NoImplementationError, PlatformError
from .specs import CaptureSpec

log = logging.getLogger("omni.step_graphs")
_POOL_IDS = itertools.count(1)


def batch_signature(states) -> tuple:
    """The active rows' ``(prefix_len, token_h, token_w)``, in packing order."""
    return tuple((r.seq.prefix_len, r.seq.token_h, r.seq.token_w) for s in states for r in s.rows)


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def step_key(states, keys_to: int = 0) -> tuple:
    """(signature, binding): what a step graph is looked up by; the binding (prefix lengths, KV pages) says
    which values its tables hold.

    ``keys_to`` 0: the signature is every row's ``(prefix_len, token_h, token_w)``
    (tables of another prefix length have other shapes). ``keys_to`` > 0 (the
    key tables padded to that length, ``padded_keys``): prefix lengths leave the
    signature, so requests of other prompt lengths replay the same graph with
    their tables copied in.
    """
    rows = [r for s in states for r in s.rows]
    binding = tuple((r.seq.prefix_len, tuple(r.pages)) for r in rows)
    if not keys_to:
        return batch_signature(states), binding
    return (tuple((r.seq.token_h, r.seq.token_w) for r in rows), keys_to), binding


def row_bucket(n: int) -> int:
    """The rows a captured decode step of ``n`` text rows runs: ``n`` up to 4, then the next power of two. As
    answers join and finish, the row count changes at every step boundary; without buckets each count would
    be a graph of its own (at 32 layers on the H200 a step took 11-17 ms and a first run with its captures
    0.2-0.6 s more; 24 answers finishing one by one ran below eager with a graph per count, BENCHMARKS.md)."""
    return n if n <= 4 else 1 << (n - 1).bit_length()


def geometric_keys(keys_to: int, bucket: int) -> int:
    """``keys_to`` (a multiple of ``bucket``) up to the next power-of-two multiple of ``bucket``: the key
    tables of a decode step grow by a token a row per step, so linear buckets would be crossed every
    ``bucket / rows`` steps; doubling ones are crossed a few times an answer."""
    if keys_to <= bucket:
        return keys_to
    return bucket << (-(-keys_to // bucket) - 1).bit_length()


def text_key(runs, keys_to: int) -> tuple:
    """(signature, binding) of a decode step (one query per text row, ``text_steps.decode_step``): its row count
    and key length; the binding (every row's keys and pages) changes at every token, so each step rebinds."""
    return ("text", len(runs), keys_to), tuple((r.k_end, tuple(r.pages)) for r in runs)


def padded_keys(runs, bucket: int, paged: bool, page_size: int) -> int:
    """The key length a step's tables pad to: the longest run's pages (paged) or all runs' gathered keys,
    rounded up to ``bucket`` tokens; 0 (no padding) when ``bucket`` is 0."""
    if not bucket:
        return 0
    if paged:
        return round_up(max(len(r.pages) for r in runs) * page_size, round_up(bucket, page_size))
    return round_up(sum(r.k_end for r in runs), bucket)


def static_tensors(obj) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` (tuples, lists, dataclasses, plain objects), in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in static_tensors(item)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in static_tensors(getattr(obj, f.name))]
    if hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) and type(obj).__module__.startswith("omni"):
        return [t for _, v in sorted(vars(obj).items()) for t in static_tensors(v)]
    return []


@dataclass
class _Entry:
    runner: object
    x: torch.Tensor  # static input
    args: tuple  # static constant arguments (tables, context)
    out: object  # static outputs
    binding: tuple
    statics: list  # ``static_tensors(args)``, walked once at capture (a decode step rebinds at every token)


class StepGraphs:
    """Captured step backbones per batch signature (see the module docstring)."""

    def __init__(self, platform, device_type: str, *, max_graphs: int = 4, strict: bool = True,
                 name: str = "denoise_step", key_bucket: int = 0, collectives: str = ""):
        self.platform, self.device_type, self.max_graphs, self.name = platform, device_type, max_graphs, name
        self.collectives = collectives  # the backend of collectives inside the region (tp's all-reduces)
        self.key_bucket = key_bucket  # > 0: prompt lengths share graphs (``step_key``)
        self._graphs: OrderedDict[tuple, _Entry] = OrderedDict()
        self.pool_id = next(_POOL_IDS)  # one memory pool for all this object's graphs (see the module docstring)
        self.refusal: str | None = None
        self.captures = self.replays = self.rebinds = 0
        try:  # ask once, up front: a platform that cannot capture says why now, not at the first step
            platform.graph_runner(CaptureSpec(device_type=device_type, name=f"{name}[probe]", collectives=collectives))
        except NoImplementationError as err:
            if strict:
                raise PlatformError(f"graph.mode=capture: {err}") from err
            self.refusal = str(err)
            log.warning("graph.mode=capture refused, running eagerly: %s", err)

    @property
    def enabled(self) -> bool:
        return self.refusal is None

    def run(self, key: tuple, x_TD: torch.Tensor, forward: Callable, make_args: Callable[[], tuple]):
        """``forward(x_TD, *make_args())``, replayed from the graph of ``key``'s signature."""
        if not self.enabled or compile_pass.active():  # a compile pass's kernels do not run: nothing to record
            return forward(x_TD, *make_args())
        signature, binding = key
        entry = self._graphs.get(signature)
        if entry is None or tuple(entry.x.shape) != tuple(x_TD.shape) or entry.x.dtype != x_TD.dtype:
            entry = self._capture(signature, binding, x_TD, forward, make_args)
        else:
            self._graphs.move_to_end(signature)
            if entry.binding != binding:
                self._rebind(entry, make_args(), binding)
        entry.x.copy_(x_TD)
        entry.runner.replay()
        self.replays += 1
        return entry.out

    def _capture(self, signature, binding, x_TD, forward, make_args) -> _Entry:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)  # the graph and its pool go with the entry
        spec = CaptureSpec(device_type=self.device_type,
                           name=f"{self.name}[{len(signature)} rows, {x_TD.shape[0]} tok]",
                           pool_id=self.pool_id, collectives=self.collectives)
        runner = self.platform.graph_runner(spec)
        x, args = x_TD.clone(), make_args()
        out = runner.capture(lambda: forward(x, *args))
        entry = self._graphs[signature] = _Entry(runner, x, args, out, binding, static_tensors(args))
        self.captures += 1
        log.info("captured %s", getattr(runner, "name", spec.name))
        return entry

    def _rebind(self, entry: _Entry, args: tuple, binding: tuple) -> None:
        """Copy another row set's tables (same signature, same shapes) into the captured ones."""
        old, new = entry.statics, static_tensors(args)
        if len(old) != len(new) or any(o.shape != n.shape or o.dtype != n.dtype for o, n in zip(old, new)):
            raise RuntimeError(f"{self.name}: the tables of signature changed shape; capture again")
        for o, n in zip(old, new):
            if o.data_ptr() != n.data_ptr():  # shared state (the KV pool itself) is the same tensor
                o.copy_(n)
        entry.binding = binding
        self.rebinds += 1

    def clear(self) -> None:
        self._graphs.clear()
