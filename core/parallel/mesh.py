"""The device mesh: degrees, each rank's coordinates, and one process group per axis.

Ranks are laid out row-major over ``AXES = (dp, cfg, ulysses, ring, tp)``,
tp fastest, so the ranks that talk most (tp all-reduces every layer) are
neighbours (same host, NVLink). A *replica* is one dp slice: the
``cfg * ulysses * ring * tp`` ranks that run one pipeline in lock-step.

Expert parallelism reuses ranks: the ep group is ``ep`` consecutive ranks of
a replica. Two cases (``ExpertLayout``):

- ``ep <= tp`` (ep divides tp): the ep group lies inside one tp group, whose
  ranks hold the same tokens. Experts are split into ``ep`` groups and each
  expert's intermediate dim over ``tp / ep`` ranks; every rank runs its
  experts on its own (replicated) tokens and the tp all-reduce that ends the
  MoE sums everything. No all-to-all is needed.
- ``ep > tp`` (tp divides ep): the group spans ``ep / tp`` tp groups with
  different tokens (cfg rows or sequence chunks). Experts are split into
  ``ep / tp`` groups, each expert's intermediate dim over tp; tokens travel to
  their experts' rank by all-to-all among the ranks of the group that share a
  tp index (the *dispatch* group), then come back.

Shape words: degree = size of an axis; index = this rank's coordinate on it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

AXES = ("dp", "cfg", "ulysses", "ring", "tp")


class MeshError(ValueError):
    """Degrees that cannot form a mesh, or a model that cannot be split by them; the message says why."""


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """Parallel degrees of one deployment (``Recipe.parallel``); world = dp*cfg*ulysses*ring*tp."""

    dp: int = 1
    cfg: int = 1
    ulysses: int = 1
    ring: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        bad = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) < 1]
        if bad:
            raise MeshError(f"parallel degrees must be >= 1: {', '.join(bad)}")
        if self.cfg not in (1, 2):
            raise MeshError(f"parallel.cfg={self.cfg}: the guidance rows are two (cfg is 1 or 2)")
        if self.ulysses > 1 and self.ring > 1:
            raise MeshError(f"parallel.ulysses={self.ulysses} with parallel.ring={self.ring}: combining both "
                            "(USP) is not implemented; choose one sequence-parallel axis")
        r, t, e = self.replica_size, self.tp, self.ep
        if r % e:
            raise MeshError(f"parallel.ep={e} must divide the ranks of one replica (cfg*ulysses*ring*tp = {r}); "
                            "replicas (dp) are independent and never exchange tokens")
        if (e <= t and t % e) or (e > t and e % t):
            raise MeshError(f"parallel.ep={e} and parallel.tp={t}: one must divide the other (an ep group lies "
                            "inside a tp group, or spans whole tp groups)")

    @classmethod
    def from_recipe(cls, parallel) -> "Degrees":
        """From ``omni.recipe.Parallel`` (or anything with the same attributes)."""
        return cls(**{f.name: getattr(parallel, f.name) for f in fields(cls)})

    @classmethod
    def parse(cls, text: str) -> "Degrees":
        """``"tp2"``, ``"cfg2xtp2"``, ``"ulysses2xtp2"``, ``"tp2xep2"`` -> Degrees ("" or "single" = all 1)."""
        import re

        kw = {}
        for part in filter(None, text.replace("single", "").split("x")):
            m = re.fullmatch(r"(dp|cfg|ulysses|ring|tp|ep)(\d+)", part)
            if not m:
                raise MeshError(f"bad layout {text!r}: parts look like tp2, cfg2, ulysses2, ring2, ep2, dp2")
            kw[m[1]] = int(m[2])
        return cls(**kw)

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def replica_size(self) -> int:
        return self.cfg * self.ulysses * self.ring * self.tp

    @property
    def world_size(self) -> int:
        return self.dp * self.replica_size

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def label(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in (*AXES, "ep") if getattr(self, a) > 1]
        return "x".join(parts) or "single"


def coords_of(rank: int, degrees: Degrees) -> dict[str, int]:
    """This rank's index on every axis (row-major, tp fastest)."""
    out, rest = {}, rank
    for axis in reversed(AXES):
        size = getattr(degrees, axis)
        out[axis], rest = rest % size, rest // size
    return {a: out[a] for a in AXES}


def rank_of(coords: dict[str, int], degrees: Degrees) -> int:
    rank = 0
    for axis in AXES:
        rank = rank * getattr(degrees, axis) + coords[axis]
    return rank


def axis_groups(degrees: Degrees, axes: tuple[str, ...]) -> list[list[int]]:
    """Every group of ranks that differ only along ``axes`` (each sorted), in a fixed order."""
    groups: dict[tuple, list[int]] = {}
    for rank in range(degrees.world_size):
        c = coords_of(rank, degrees)
        key = tuple(c[a] for a in AXES if a not in axes)
        groups.setdefault(key, []).append(rank)
    return list(groups.values())


@dataclass(frozen=True)
class ExpertLayout:
    """How routed experts are split for one rank (see the module docstring)."""

    groups: int  # expert groups (experts per rank = E / groups)
    group_index: int
    expert_tp: int  # ranks splitting one expert's intermediate dim
    expert_tp_index: int
    dispatch: int  # ranks exchanging tokens by all-to-all (1 = tokens already on the right rank)

    def expert_range(self, num_experts: int) -> range:
        if num_experts % self.groups:
            raise MeshError(f"{num_experts} experts cannot be split into {self.groups} expert-parallel groups")
        n = num_experts // self.groups
        return range(self.group_index * n, (self.group_index + 1) * n)


def expert_layout(degrees: Degrees, rank: int) -> ExpertLayout:
    c, t, e = coords_of(rank, degrees), degrees.tp, degrees.ep
    in_replica = rank % degrees.replica_size
    if e <= t:
        return ExpertLayout(groups=e, group_index=c["tp"] % e, expert_tp=t // e, expert_tp_index=c["tp"] // e,
                            dispatch=1)
    return ExpertLayout(groups=e // t, group_index=(in_replica % e) // t, expert_tp=t, expert_tp_index=c["tp"],
                        dispatch=e // t)


def dispatch_groups(degrees: Degrees) -> list[list[int]]:
    """Ranks exchanging tokens for the experts: same replica, same ep block, same tp index."""
    if degrees.ep <= degrees.tp:
        return []
    r, e, t = degrees.replica_size, degrees.ep, degrees.tp
    groups = []
    for replica in range(degrees.dp):
        for block in range(r // e):
            base = replica * r + block * e
            groups += [[base + j * t + i for j in range(e // t)] for i in range(t)]
    return groups


class Mesh:
    """This rank's place in the mesh and a ``Comm`` per axis.

    ``comm(axis)`` for axis in dp, cfg, ulysses, ring, tp, plus ``sp`` (the
    sequence-parallel axis in use), ``dispatch`` (expert all-to-all),
    ``replica`` (all ranks of this replica) and ``world``. Axes of size 1 get
    a trivial Comm whose collectives return their input.
    """

    def __init__(self, degrees: Degrees, rank: int, comms: dict, control: dict | None = None):
        self.degrees, self.rank = degrees, rank
        self.coords = coords_of(rank, degrees)
        self.experts = expert_layout(degrees, rank)
        self._comms, self._control = comms, control or {}

    @classmethod
    def build(cls, degrees: Degrees, *, platform=None, device_type: str = "cpu", stats=None) -> "Mesh":
        """Create every process group (all ranks call this, same order); needs an initialised default group."""
        import torch.distributed as dist

        from .comm import Comm

        world, rank = dist.get_world_size(), dist.get_rank()
        if world != degrees.world_size:
            raise MeshError(f"{degrees.label()} needs {degrees.world_size} ranks, the job has {world}")
        wanted = {a: axis_groups(degrees, (a,)) for a in AXES}
        wanted["sp"] = axis_groups(degrees, ("ulysses", "ring"))
        wanted["replica"] = axis_groups(degrees, ("cfg", "ulysses", "ring", "tp"))
        wanted["dispatch"] = dispatch_groups(degrees)
        wanted["world"] = [list(range(world))]
        comms, control = {}, {}
        for axis, groups in wanted.items():
            for ranks in groups:
                group = _new_group(dist, ranks, world)
                if rank in ranks:
                    comms[axis] = Comm.create(axis, group, ranks, rank, platform=platform,
                                              device_type=device_type, stats=stats)
        for ranks in wanted["replica"]:  # host-side control messages (driver -> followers) always go over gloo
            group = _new_group(dist, ranks, world, backend="gloo")
            if rank in ranks:
                control["replica"] = Comm.create("replica", group, ranks, rank, device_type="cpu")
        for axis in wanted:
            comms.setdefault(axis, Comm.trivial(axis, rank))
        control.setdefault("replica", Comm.trivial("replica", rank))
        return cls(degrees, rank, comms, control)

    @classmethod
    def single(cls) -> "Mesh":
        """The mesh of a one-process deployment (every Comm trivial; no torch.distributed needed)."""
        from .comm import Comm

        axes = (*AXES, "sp", "replica", "dispatch", "world")
        comms = {a: Comm.trivial(a, 0) for a in axes}
        return cls(Degrees(), 0, comms, {"replica": Comm.trivial("replica", 0)})

    def comm(self, axis: str):
        return self._comms[axis]

    def comms(self) -> list:
        """Every distinct tensor Comm of this rank (for benchmarks: stats, comm-free variant)."""
        return list({id(c): c for c in self._comms.values()}.values())

    def instrument(self, stats=None, enabled: bool = True) -> None:
        """Benchmarks only: time collectives into ``stats``; ``enabled=False`` skips exchanges (wrong results)."""
        for c in self.comms():
            c.stats, c.enabled = stats, enabled

    def control(self, axis: str = "replica"):
        return self._control[axis]

    def size(self, axis: str) -> int:
        return self._comms[axis].size

    def index(self, axis: str) -> int:
        return self._comms[axis].rank

    @property
    def sp_kind(self) -> str:
        return "ulysses" if self.degrees.ulysses > 1 else "ring" if self.degrees.ring > 1 else "none"

    def __repr__(self) -> str:
        return f"Mesh({self.degrees.label()}, rank {self.rank}, coords {self.coords})"


def _new_group(dist, ranks: list[int], world: int, backend: str | None = None):
    if len(ranks) == 1:
        return None
    if len(ranks) == world and backend is None:
        return dist.group.WORLD
    return dist.new_group(ranks, backend=backend)
