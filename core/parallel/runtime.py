"""The per-worker runtime: what the pipeline builder and the step engine ask of the devices.

Model code never imports torch.distributed; it receives one of these objects
and calls plain methods, the same on one device (``SingleDevice``) as on a
mesh (``ParallelRuntime``), so no caller branches on which it has:

    build time   shard_model(model, plan, ...)  -> PlanResult (ParallelRuntime only: apply the plan)
                 pool_kv_heads(K)               -> kv heads this rank's KV pool stores
                 capture_refusal()              -> why the step cannot be recorded into a graph, or None
                 step_collectives               -> the backend of the collectives inside a step ("" none)
    run time     cfg_rows(n)                    -> which rows of a request this rank computes
                 exchange_predictions(...)      -> every row's velocity after a step
                 run_backbone(...)              -> the backbone over one packed forward
                 tiled_decode(...)              -> VAE tiles spread over the replica's ranks
                 replica_size                   -> ranks that run this pipeline in lock-step
"""
from __future__ import annotations

from typing import Protocol

from omni.build_options import BuildOptions
from omni.kv_pool import PoolContext
from omni.vae_tiling import tiled_decode

from .cfg import CfgSplit
from .sequence import SequenceParallelRunner
from .tp import PlanResult, apply_plan
from .ulysses import kv_heads_per_rank


class Runtime(Protocol):
    """What the step engine needs of the devices it runs on (see the module docstring)."""

    @property
    def replica_size(self) -> int: ...

    def pool_kv_heads(self, num_kv_heads: int, num_heads: int) -> int: ...

    def capture_refusal(self) -> str | None: ...

    @property
    def step_collectives(self) -> str: ...

    def cfg_rows(self, num_rows: int) -> list[int]: ...

    def exchange_predictions(self, local: list, num_rows: list[int]) -> list: ...

    def run_backbone(self, model, x_TD, cos_TH, sin_TH, *, pool, runs, mask: str, paged: bool, device): ...

    def tiled_decode(self, decode, z_BChw, *, tile: int, overlap: int, factor: int, lanes=None): ...


class SingleDevice:
    """One worker alone: every row here, nothing to exchange, the backbone and the tiles in this process."""

    replica_size = 1
    step_collectives = ""

    def __repr__(self) -> str:
        return "SingleDevice()"

    def capture_refusal(self) -> str | None:
        return None

    def pool_kv_heads(self, num_kv_heads: int, num_heads: int) -> int:
        return num_kv_heads

    def cfg_rows(self, num_rows: int) -> list[int]:
        return list(range(num_rows))

    def exchange_predictions(self, local: list, num_rows: list[int]) -> list:
        return local

    def run_backbone(self, model, x_TD, cos_TH, sin_TH, *, pool, runs, mask: str, paged: bool, device):
        return model.backbone(x_TD, cos_TH, sin_TH, PoolContext(pool, runs, mask=mask, paged=paged, device=device))

    def tiled_decode(self, decode, z_BChw, *, tile: int, overlap: int, factor: int, lanes=None):
        return tiled_decode(decode, z_BChw, tile=tile, overlap=overlap, factor=factor, lanes=lanes)


class ParallelRuntime:
    def __init__(self, mesh, platform):
        self.mesh, self.platform = mesh, platform
        self.cfg = CfgSplit(mesh.comm("cfg"))
        self.sp = SequenceParallelRunner(mesh) if mesh.sp_kind != "none" else None

    def __repr__(self) -> str:
        return f"ParallelRuntime({self.mesh})"

    # ------------------------------------------------------------ build time

    def shard_model(self, model, plan, *, cfg, opts: BuildOptions) -> PlanResult:
        return apply_plan(model, plan, mesh=self.mesh, platform=self.platform, cfg=cfg, opts=opts)

    def pool_kv_heads(self, num_kv_heads: int, num_heads: int) -> int:
        tp = self.mesh.size("tp")
        local = num_kv_heads // tp
        if self.mesh.sp_kind == "ulysses":
            return kv_heads_per_rank(num_heads // tp, local, self.mesh.size("ulysses"))
        return local

    def capture_refusal(self) -> str | None:
        """Why this layout's denoising step cannot be recorded into a device graph; None when it can.

        Recordable: tp (its all-reduces have fixed shapes; ``step_collectives``
        tells the platform which backend records them) and cfg (its exchange
        runs between replays). Not: ep, whose dispatch reads routing counts on
        the host, and sequence parallelism, whose runner splits each forward on
        the host around the backbone the step graph records.
        """
        d = self.mesh.degrees
        if d.ep > 1:
            return f"parallel.ep={d.ep}: expert parallelism reads its routing counts on the host (omni.parallel.ep)"
        if self.sp is not None:
            kind = self.mesh.sp_kind
            return (f"parallel.{kind}={getattr(d, kind)}: the sequence-parallel runner splits each forward on the "
                    "host, outside the recorded backbone (omni.parallel.sequence)")
        return None

    @property
    def step_collectives(self) -> str:
        """The backend of the collectives inside a denoising step's backbone: tp's all-reduces ("" without tp)."""
        return self.mesh.comm("tp").backend

    # ------------------------------------------------------------ run time

    @property
    def replica_size(self) -> int:
        return self.mesh.size("replica")

    def cfg_rows(self, num_rows: int) -> list[int]:
        return self.cfg.rows(num_rows)

    def exchange_predictions(self, local: list, num_rows: list[int]) -> list:
        return self.cfg.exchange(local, num_rows)

    def run_backbone(self, model, x_TD, cos_TH, sin_TH, *, pool, runs, mask: str, paged: bool, device):
        if self.sp is not None:
            return self.sp(model, x_TD, cos_TH, sin_TH, pool=pool, runs=runs, mask=mask, paged=paged, device=device)
        ctx = PoolContext(pool, runs, mask=mask, paged=paged, device=device)
        return model.backbone(x_TD, cos_TH, sin_TH, ctx)

    def tiled_decode(self, decode, z_BChw, *, tile: int, overlap: int, factor: int, lanes=None):
        """Each rank of the replica decodes its share of the tiles; one all-reduce assembles them."""
        comm = self.mesh.comm("replica")
        return tiled_decode(decode, z_BChw, tile=tile, overlap=overlap, factor=factor,
                            rank=comm.rank, world=comm.size, all_reduce=comm.all_reduce, lanes=lanes)
