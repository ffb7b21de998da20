"""One worker process per rank: spawn, initialise, build the mesh, run, tear down.

    launch(fn, Degrees(tp=2), platform="cpu")       # spawns 2 local workers, returns their results
    python -m omni.parallel.launch --tp 2 pkg.mod:fn  # the same from a shell
    torchrun --nproc-per-node 2 -m omni.parallel.launch --tp 2 pkg.mod:fn

Every worker: selects the platform, binds its device through
``Platform.device_services(local_rank)``, initialises torch.distributed with
``Platform.dist_backend()`` over a TCP store, builds the ``Mesh`` and calls
``fn(ctx, *args)`` with a ``WorkerContext``. Its return value (picklable)
comes back to ``launch``.

Teardown: the first rank that fails makes ``launch`` stop every other worker
(SIGTERM, then SIGKILL) and raise ``WorkerError`` with that rank's
traceback; a peer blocked in a collective never keeps the job alive. Ctrl-C
stops all workers: workers ignore SIGINT (a terminal sends it to the whole
process group), so the launcher alone decides how they end -- it stops them
when interrupted, or, when ``launch`` runs in a thread of a server, the
server stops them in order (``cancel`` stops them at once). A worker whose
launcher dies (even by SIGKILL) exits on its own: it watches a pipe whose
other end only the launcher holds.

Environment variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT from torchrun) are read in ``main()``
only, turned into a ``RankInfo`` and passed down explicitly.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from .mesh import Degrees
from .supervise import TERMINATE_GRACE_S, WorkerError, join_all, stop_all, supervise



@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # "" = a TCP store at master_addr:master_port (rank 0 hosts it). Under torchrun: "env://", so torch joins
    # the store torchrun's agent already hosts on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE).
    init_method: str = ""
    # the local device this rank binds (None: its local rank) and the torch.distributed backend ("": the
    # platform's). Several ranks on one device (``shares_device``) is for tests on a one-GPU machine: the
    # platform names the environment that takes (``omni_shared_device_env``; NCCL needs a host id per rank).
    device_index: int | None = None
    backend: str = ""
    shares_device: bool = False

    @property
    def local_device(self) -> int:
        """The index of the local device this rank binds."""
        return self.local_rank if self.device_index is None else self.device_index

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "RankInfo | None":
        """The torchrun variables, or None when ``env`` has no RANK (not under torchrun)."""
        if "RANK" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        return cls(rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)), node_rank=int(env.get("GROUP_RANK", 0)),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
                   init_method="env://")


@dataclass
class WorkerContext:
    """What ``fn`` receives: rank info, the platform, this rank's device services and the mesh."""

    info: RankInfo
    degrees: Degrees
    platform: Any
    services: Any
    mesh: Any

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def device(self):
        return self.services.device


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_target(fn: Callable | str) -> Callable:
    """A callable, or ``"package.module:function"``."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    if not name:
        raise ValueError(f"target {fn!r} must look like package.module:function")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------- one worker


def run_worker(fn: Callable | str, info: RankInfo, degrees: Degrees, *, platform: str = "cpu",
               args: tuple = (), dist_timeout_s: float = 300.0, threads: int | None = None):
    """Initialise this rank, build the mesh, run ``fn(ctx, *args)``, tear down; returns fn's result."""
    import torch
    import torch.distributed as dist

    from omni.platform_manager import select

    from .mesh import Mesh

    if threads:  # host threads per worker, as torchrun's OMP_NUM_THREADS: workers share the host CPUs
        torch.set_num_threads(threads)
    # as torchrun sets it: what shares this host's CPUs with this rank (a platform's kernel compile threads)
    os.environ["LOCAL_WORLD_SIZE"] = str(info.local_world_size)
    if info.world_size != degrees.world_size:
        raise ValueError(f"{degrees.label()} needs {degrees.world_size} ranks, the job has {info.world_size}")
    plat = select(platform)
    services = plat.device_services(info.local_device)
    init = info.init_method or f"tcp://{info.master_addr}:{info.master_port}"
    backend = info.backend or plat.dist_backend()
    if info.shares_device:
        os.environ.update(plat.shared_device_env(info.rank, backend))
    dist.init_process_group(backend, init_method=init,
                            rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=dist_timeout_s))
    try:
        mesh = Mesh.build(degrees, platform=plat, device_type=plat.info.device_type)
        return resolve_target(fn)(WorkerContext(info, degrees, plat, services, mesh), *args)
    finally:
        try:
            dist.destroy_process_group()
        finally:
            plat.shutdown()


def _watch_parent(conn) -> None:
    """Exit when the launcher is gone (its end of the pipe closes), so no worker outlives it."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(70)


def _thread_lock_for_progress_bars() -> None:
    """Give tqdm a thread lock before it makes its default one.

    tqdm's default write lock includes a multiprocessing RLock: in a spawned process a named semaphore,
    registered with the launcher's resource tracker. A rank stopped while it loads (SIGTERM -> os._exit)
    never unlinks it, and the tracker then warns about a leaked semaphore on the launcher's stderr. A
    spawned rank's RLock excludes nothing across processes anyway (each rank makes its own).
    """
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _child(fn, info: RankInfo, degrees: Degrees, platform: str, args: tuple, dist_timeout_s: float,
           threads: int, report, lifeline) -> None:
    # Ctrl-C in a terminal signals the whole process group. A worker that died of it on its own would cut
    # the launcher's connections mid-shutdown (a server would see EOF from its replicas and call them dead);
    # instead the launcher, which owns the workers, stops them or lets them finish. SIG_IGN also discards a
    # SIGINT that arrived while this interpreter started (``launch`` spawns with SIGINT blocked).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.Thread(target=_watch_parent, args=(lifeline,), daemon=True, name="omni-lifeline").start()
    _thread_lock_for_progress_bars()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    try:
        result = run_worker(fn, info, degrees, platform=platform, args=args, dist_timeout_s=dist_timeout_s,
                            threads=threads)
    except KeyboardInterrupt:  # raised by fn itself: SIGINT is ignored here
        report.send(("interrupted", info.rank, "interrupted (Ctrl-C)", "", time.time()))
        os._exit(130)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher with its traceback, then exit 1
        report.send(("error", info.rank, f"{type(e).__name__}: {e}", traceback.format_exc(), time.time()))
        sys.stderr.flush()
        os._exit(1)
    try:  # plain pickle: tensors travel as bytes, not as shared memory that dies with this process
        report.send(("ok", info.rank, pickle.dumps(result), "", time.time()))
    except Exception as e:  # noqa: BLE001 - an unpicklable result is this rank's error
        report.send(("error", info.rank, f"result of rank {info.rank} cannot be sent back: {e}", "", time.time()))
        os._exit(1)
    report.close()


# ---------------------------------------------------------------------- the launcher


def launch(fn: Callable | str, degrees: Degrees, *, platform: str = "cpu", args: tuple = (),
           nproc_per_node: int | None = None, nnodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", master_port: int | None = None, timeout_s: float | None = None,
           dist_timeout_s: float = 300.0, cancel: threading.Event | None = None, devices: int | None = None,
           backend: str = "") -> list:
    """Spawn this node's workers, wait for all, return their results (local rank order).

    ``devices``: local devices the workers bind, local rank modulo ``devices``
    (None: one each). ``backend``: the torch.distributed backend ("" for the
    platform's). Both exist for tests on a one-GPU machine: ranks that share
    a device set the environment their platform names for it
    (``omni_shared_device_env``: on CUDA, NCCL talks over its socket
    transport, correct and slow); gloo needs nothing.

    ``fn`` must be importable by name (a module-level function or
    ``"module:function"``): workers are fresh interpreters (spawn), never forks
    of a process that may hold device contexts or threads. Setting ``cancel``
    (from another thread) stops every worker and raises ``LaunchCancelled``:
    the workers ignore SIGINT, so a caller that runs ``launch`` in a thread
    uses it to end them when it is interrupted or gives up waiting.
    """
    nproc = _procs_on_this_node(degrees, nproc_per_node, nnodes)
    if master_port is None:
        if nnodes > 1:
            raise ValueError("a multi-node launch needs an explicit master_port that every node agrees on")
        master_port = free_port(master_addr)
    threads = max(1, (os.cpu_count() or 1) // nproc)
    base = RankInfo(rank=0, world_size=degrees.world_size, local_rank=0, local_world_size=nproc,
                    node_rank=node_rank, master_addr=master_addr, master_port=master_port)
    ctx = mp.get_context("spawn")
    procs, reports, lifelines = [], {}, []
    try:
        for info in _ranks_on_this_node(base, devices, backend):
            _spawn(ctx, (fn, info, degrees, platform, args, dist_timeout_s, threads), procs, reports, lifelines)
        results = supervise(procs, reports, timeout_s, cancel)
        # Every rank reported: let each finish exiting (multiprocessing's exit handlers unlink its semaphores)
        # before stop_all terminates the stragglers; a SIGTERM now would leak them, and the resource tracker
        # warns about them on stderr.
        join_all(procs, TERMINATE_GRACE_S)
        return results
    finally:
        stop_all(procs)
        for conn in lifelines:
            conn.close()


def _procs_on_this_node(degrees: Degrees, nproc_per_node: int | None, nnodes: int) -> int:
    nproc = nproc_per_node or degrees.world_size // nnodes
    if nproc * nnodes != degrees.world_size:
        raise ValueError(f"{degrees.label()} needs {degrees.world_size} ranks; {nnodes} node(s) x {nproc} "
                         f"process(es) = {nproc * nnodes}")
    return nproc


def _ranks_on_this_node(base: RankInfo, devices: int | None, backend: str) -> list[RankInfo]:
    """One ``RankInfo`` per local rank; ranks share a device when there are fewer ``devices`` than ranks."""
    nproc = base.local_world_size
    return [replace(base, rank=base.node_rank * nproc + local, local_rank=local,
                    device_index=None if devices is None else local % devices, backend=backend,
                    shares_device=devices is not None and nproc > devices) for local in range(nproc)]


def _spawn(ctx, child_args: tuple, procs: list, reports: dict, lifelines: list) -> None:
    """Start one worker (``_child(*child_args, report pipe, lifeline)``) and keep its ends of the pipes."""
    rank = child_args[1].rank
    recv, send = ctx.Pipe(duplex=False)
    life_r, life_w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, name=f"omni-rank{rank}", daemon=False, args=(*child_args, send, life_r))
    # Known before it starts: a Ctrl-C held back while it spawned is raised as the mask comes off, and the
    # caller's finally must stop this worker too (an unknown one would keep the interpreter's exit waiting).
    procs.append(p)
    lifelines.append(life_w)
    with _sigint_blocked():
        p.start()
    send.close()
    life_r.close()
    reports[recv] = rank


@contextlib.contextmanager
def _sigint_blocked():
    """Block SIGINT in this thread while it spawns a worker, which inherits the mask through fork and exec.

    A Ctrl-C during the worker's interpreter startup then stays pending until ``_child`` ignores it, instead
    of a KeyboardInterrupt traceback from the child's bootstrap (multiprocessing's resource tracker starts
    the same way). The signal still reaches this process: another thread (or this one, afterwards) takes it.
    """
    if not hasattr(signal, "pthread_sigmask"):  # Windows: no signal masks
        yield
        return
    # Spawning may start multiprocessing's resource tracker first, and that start ends with an unconditional
    # SIG_UNBLOCK of SIGINT in this thread, which would undo ours: start it before blocking.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)




# ---------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m omni.parallel.launch", description=__doc__.split("\n")[0])
    ap.add_argument("target", help="package.module:function called as fn(ctx, *args) on every rank")
    ap.add_argument("args", nargs="*", help="string arguments passed to the target")
    ap.add_argument("--platform", default="cpu")
    ap.add_argument("--recipe", help="take the degrees from this recipe's parallel section")
    for axis in ("dp", "cfg", "ulysses", "ring", "tp", "ep"):
        ap.add_argument(f"--{axis}", type=int, default=1)
    ap.add_argument("--nproc-per-node", type=int)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int)
    ap.add_argument("--timeout", type=float, help="seconds before the whole job is stopped")
    return ap.parse_args(argv)


def degrees_from_args(ns: argparse.Namespace) -> Degrees:
    if ns.recipe:
        from omni.recipe import load_recipe

        return Degrees.from_recipe(load_recipe(ns.recipe).parallel)
    return Degrees(**{a: getattr(ns, a) for a in ("dp", "cfg", "ulysses", "ring", "tp", "ep")})


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    ns = parse_args(argv)
    degrees = degrees_from_args(ns)
    info = RankInfo.from_env(os.environ if env is None else env)
    try:
        if info is not None:  # under torchrun: this process is one rank
            result = run_worker(ns.target, info, degrees, platform=ns.platform, args=tuple(ns.args))
            results = [result]
        else:
            results = launch(ns.target, degrees, platform=ns.platform, args=tuple(ns.args),
                             nproc_per_node=ns.nproc_per_node, nnodes=ns.nnodes, node_rank=ns.node_rank,
                             master_addr=ns.master_addr, master_port=ns.master_port, timeout_s=ns.timeout)
    except WorkerError as e:
        print(f"omni.parallel.launch: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("omni.parallel.launch: interrupted; all workers stopped", file=sys.stderr)
        return 130
    for r in results:
        if r is not None:
            print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
