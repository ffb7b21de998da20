"""Our CUTLASS build of the grouped e4m3 expert GEMM (``kernels.grouped_fp8``), compiled once per machine.

Why: torch._scaled_grouped_mm compiles one tile per shape class. At the
released MoE shapes with fast accumulation it runs 256x128 tiles in 2x2
clusters, and a routed split (expert groups of uneven length, not multiples
of 256) wastes part of every group's last tile row. CUTLASS's own
ptr-array kernel built with 128x128 ping-pong tiles in 1x2 clusters measured
1251 / 1246 TFLOP/s against torch's 975 / 980 on the routed split (gate_up /
down, H200, same run; bench/bench_cutlass_grouped.py, BENCHMARKS.md), with
bit-identical outputs.

How: ``csrc/grouped_fp8.cu`` holds the kernel behind a C ABI (raw pointers and
the stream; no torch headers, so no torch-version coupling). ``build``
writes a one-configuration translation unit, compiles it with nvcc against the
headers of the ``nvidia-cutlass`` package (the ``cuda`` extra) and keeps the
shared object in ``OMNI_KERNEL_CACHE`` (default ``~/.cache/omni-run/kernels``)
under a key of the source, the configuration, the compiler and the headers;
ranks building at once wait on a file lock and load the same object. The
library is loaded with ctypes and called with the current stream, so a
call is capturable; its scratch (per-group pointers, CUTLASS's workspace)
comes from torch's allocator per call, as torch's own kernel does.

Before this process runs an object on a device model for the first time, a
child process self-tests it there (``python -m omni.platforms.cuda.cutlass_grouped``).
A kernel that faults would leave a sticky CUDA error behind, and the process
could then not fall back to torch's kernel. The verdict is kept beside the
object, keyed by device model and driver, so the child runs once per machine.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("omni.platforms")

SOURCE = Path(__file__).parent / "csrc" / "grouped_fp8.cu"
ARCH = "sm_90a"  # wgmma and TMA: the kernel is Hopper-only


@dataclass(frozen=True)
class TileConfig:
    """One instantiation of the kernel: tile (M, N, K), cluster (M, N), schedule, accumulation and epilogue.

    ``swiglu``: the epilogue computes ``x1 * silu(x2)`` of each adjacent column pair and writes it as bf16, so
    the output has half the columns (the weight's rows must come in (x1, x2) pairs; ``csrc/grouped_fp8.cu``).
    """

    tile: tuple[int, int, int]
    cluster: tuple[int, int]
    pingpong: bool
    fast_accum: bool
    swiglu: bool = False

    @property
    def name(self) -> str:
        m, n, _ = self.tile
        sched = "pong" if self.pingpong else "coop"
        epi = SWIGLU_SUFFIX if self.swiglu else ""
        return f"{sched}_{m}x{n}_c{self.cluster[0]}x{self.cluster[1]}_{'fast' if self.fast_accum else 'exact'}{epi}"

    def export_line(self) -> str:
        args = (*self.tile, *self.cluster, str(self.pingpong).lower(), str(self.fast_accum).lower(), int(self.swiglu))
        return f"OMNI_GG_EXPORT({self.name}, {', '.join(map(str, args))})"


SWIGLU_SUFFIX = "_swiglu"


# The configurations chosen by bench/bench_cutlass_grouped.py on the H200 (routed split, same run):
#   fast:  ping-pong 128x128, cluster 1x2   1251 / 1246 TFLOP/s (torch 975 / 980)
#   exact: cooperative 128x128, cluster 1x2  918 / 876 TFLOP/s (torch 866 / 833)
CONFIGS = {True: TileConfig((128, 128, 128), (1, 2), pingpong=True, fast_accum=True),
           False: TileConfig((128, 128, 128), (1, 2), pingpong=False, fast_accum=False)}
# The MoE's first GEMM with the SwiGLU epilogue (N = 6144 = 32 x 192): fast, ping-pong 128x192 in 1x2 clusters,
# measured against 128x128 on the H200 in one run (bench/bench_swiglu_epilogue.py --tiles, BENCHMARKS.md "Eleventh
# session"): GEMM 1 + the row quantization 2.92 vs 3.04-3.10 ms, the routed layer 4.73-4.75 vs 4.91 ms, the
# same bits; exact: the same tiles as without the epilogue (not measured at other tiles).
SWIGLU_CONFIGS = {True: TileConfig((128, 192, 128), (1, 2), pingpong=True, fast_accum=True, swiglu=True),
                  False: dataclasses.replace(CONFIGS[False], swiglu=True)}
# Where few rows reach each expert (a text decode step: 8 rows a token over 64 experts) a GEMM reads each
# expert's weight for a handful of rows and the 128-row tiles compute mostly padding: ping-pong 64x128 in 1x1
# clusters read the weights 15-17% faster at one token (BENCHMARKS.md "Fifteenth session", call 5). Fast
# accumulation only (the recipes that serve text on the H200); exact builds keep one tile.
SMALL_CONFIGS = {True: TileConfig((64, 128, 128), (1, 1), pingpong=True, fast_accum=True)}
SMALL_SWIGLU_CONFIGS = {True: dataclasses.replace(SMALL_CONFIGS[True], swiglu=True)}


def find_nvcc() -> str | None:
    """The nvcc that builds the kernel: ``$CUDA_HOME/bin``, then PATH, then /usr/local/cuda (None: absent)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = (home and str(Path(home) / "bin" / "nvcc"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def find_cutlass_include() -> str | None:
    """CUTLASS's include folder: ``$OMNI_CUTLASS_INCLUDE``, else the nvidia-cutlass package's (found, not imported)."""
    env = os.environ.get("OMNI_CUTLASS_INCLUDE")
    if env:
        return env if (Path(env) / "cutlass" / "cutlass.h").is_file() else None
    spec = importlib.util.find_spec("cutlass_library")
    for root in (spec.submodule_search_locations or []) if spec else []:
        include = Path(root) / "source" / "include"
        if (include / "cutlass" / "cutlass.h").is_file():
            return str(include)
    return None


def translation_unit(cfg: TileConfig) -> str:
    return f'#define OMNI_GG_CONFIGS {cfg.export_line()}\n#include "{SOURCE}"\n'


def compile_command(nvcc: str, include: str, src: Path, out: Path) -> list[str]:
    util = Path(include).parent / "tools" / "util" / "include"  # packed_stride.hpp
    return [nvcc, "-std=c++17", "-O3", f"-arch={ARCH}", "-shared", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
            "-DNDEBUG", f"-I{include}", f"-I{util}", str(src), "-o", str(out)]


def cache_key(cfg: TileConfig, nvcc_version: str, include: str) -> str:
    """Changes with the kernel source, the configuration, the compiler and the CUTLASS headers."""
    version_h = Path(include) / "cutlass" / "version.h"
    h = hashlib.sha256()
    for part in (SOURCE.read_text(), cfg.export_line(), nvcc_version, ARCH,
                 version_h.read_text() if version_h.is_file() else include):
        h.update(part.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("OMNI_KERNEL_CACHE") or Path.home() / ".cache" / "omni-run" / "kernels")


def build(cfg: TileConfig, nvcc: str, include: str, where: Path | None = None) -> Path:
    """The shared object of ``cfg``: from the cache, or compiled into it (about a minute, once per machine)."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    where = where or cache_dir()
    where.mkdir(parents=True, exist_ok=True)
    out = where / f"grouped_fp8_{cfg.name}_{cache_key(cfg, version, include)}.so"
    _once_under_lock(out, out, lambda: _compile(cfg, nvcc, include, out))
    return out


def _once_under_lock(library: Path, made: Path, make) -> None:
    """``make()`` unless ``made`` exists, holding ``library``'s lock file: the ranks of one host compiling or testing
    the same object wait for one of them, then find what it made."""
    import fcntl  # POSIX only, like the build itself: importing this module stays portable

    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():  # another process may have made it while this one waited
            make()


def _compile(cfg: TileConfig, nvcc: str, include: str, out: Path) -> None:
    src, tmp = out.with_suffix(".cu"), out.with_suffix(f".{os.getpid()}.tmp")
    src.write_text(translation_unit(cfg))
    log.info("cuda: compiling the CUTLASS grouped fp8 kernel %s with %s (once per machine, about a minute) -> %s",
             cfg.name, nvcc, out)
    t0 = time.monotonic()
    done = subprocess.run(compile_command(nvcc, include, src, tmp), capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"nvcc failed ({done.returncode}) building {cfg.name}:\n{tail}")
    tmp.replace(out)  # atomic: a reader never sees half an object
    log.info("cuda: built %s in %.0f s", out.name, time.monotonic() - t0)


class CutlassGroupedFp8:
    """``D[R, N] = (A[R, K] @ B[e]^T) * sa[r] * sb[e, n]`` per expert group, bf16 out (see the module docstring).

    ``config`` names one configuration the shared object ``library`` exports (``TileConfig.name``). A
    configuration with the SwiGLU epilogue (its name ends in ``_swiglu``; ``swiglu`` is then true) returns
    ``x1 * silu(x2)`` of each adjacent column pair of D instead: bf16 ``[R, N / 2]``.
    """

    def __init__(self, library: Path, config: str):
        lib = ctypes.CDLL(str(library))
        self.config, self.name = config, f"cutlass-grouped-fp8[{config}]"
        self.swiglu = config.endswith(SWIGLU_SUFFIX)
        self._run = getattr(lib, f"omni_gg_{config}_run")
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_void_p] * 2
        self._scratch = getattr(lib, f"omni_gg_{config}_scratch")
        self._scratch.restype, self._scratch.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_int]
        self._sms: dict[int, int] = {}
        self._scratch_bytes: dict[tuple[int, int], int] = {}

    def __call__(self, xq_RK, xs_R, wq_ENK, ws_EN, offs_E, *, out=None, raster: int = 0,
                 swizzle: int = 1, group_rows: int | None = None) -> torch.Tensor:
        """e4m3 rows ``[R, K]`` (+ fp32 ``[R]`` scales) x e4m3 experts ``[E, N, K]`` (+ ``[E, N]``) -> bf16 ``[R, N]``
        (``[R, N / 2]`` with the SwiGLU epilogue).

        ``raster`` (0 along M, 1 along N) and ``swizzle`` (1-8) order the tiles; the defaults, CUTLASS's own for
        groups, measured fastest (bench/bench_cutlass_grouped.py --sched). ``out``: written in place when given.
        ``group_rows`` (a bound on any group's rows, which few-row kernels size their tiles by) does not change
        these tiles.
        """
        E, N, K = wq_ENK.shape
        if out is None:
            out = torch.empty(xq_RK.shape[0], N // 2 if self.swiglu else N, dtype=torch.bfloat16, device=xq_RK.device)
        if out.numel() == 0:
            return out
        sms = self._sm_count(xq_RK.device)
        if (E, sms) not in self._scratch_bytes:
            self._scratch_bytes[E, sms] = self._scratch(E, sms)
        scratch = torch.empty(self._scratch_bytes[E, sms], dtype=torch.uint8, device=xq_RK.device)
        status = self._run(xq_RK.data_ptr(), wq_ENK.data_ptr(), out.data_ptr(), xs_R.data_ptr(), ws_EN.data_ptr(),
                           offs_E.data_ptr(), E, N, K, sms, raster, swizzle, scratch.data_ptr(),
                           torch.cuda.current_stream(xq_RK.device).cuda_stream)
        if status:
            raise RuntimeError(f"{self.name}: CUTLASS refused the call (status {status}: 1 cannot implement, "
                               f"2 initialize, 3 run, 4 launch error) for E={E} N={N} K={K} R={xq_RK.shape[0]}")
        return out

    def _sm_count(self, device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sms:
            self._sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._sms[index]


def exported_configs(library: Path) -> list[str]:
    """The configuration names a shared object built from ``grouped_fp8.cu`` exports (read from its symbols)."""
    return sorted({m.decode() for m in re.findall(rb"omni_gg_(\w+?)_run\x00", library.read_bytes())})


class BySize:
    """Two kernels of one GEMM, the same function: ``small`` where at most ``small_rows`` rows reach each expert
    group on average (rows / groups, read off the operands' shapes on the host, so a captured call keeps its
    choice) and ``small`` takes the shapes (its ``fits``, where it has one), ``large`` otherwise. Two CUTLASS
    builds whose tiles differ only in rows give the same bits; a few-row kernel of another kind
    (``grouped_skinny_triton``) sums in another order. Nests: ``large`` may itself be a ``BySize``.
    """

    def __init__(self, large, small, small_rows: int):
        if large.swiglu != small.swiglu:
            raise ValueError(f"{large.config} and {small.config} compute different epilogues")
        self.large, self.small, self.small_rows, self.swiglu = large, small, small_rows, large.swiglu
        self._fits = getattr(small, "fits", None)  # read once: the call path stays a few host integer tests
        self.config = f"{large.config}|{small.config}<={small_rows}"
        self.name = f"cutlass-grouped-fp8[{self.config}]"

    def pick(self, rows: int, groups: int):
        return self.small if rows <= self.small_rows * groups else self.large

    def __call__(self, xq_RK, xs_R, wq_ENK, ws_EN, offs_E, **kw) -> torch.Tensor:
        kernel = self.pick(xq_RK.shape[0], wq_ENK.shape[0])
        if kernel is self.small and self._fits is not None and not self._fits(xq_RK, wq_ENK, **kw):
            kernel = self.large
        return kernel(xq_RK, xs_R, wq_ENK, ws_EN, offs_E, **kw)


def config_of(fast_accum: bool, swiglu: bool = False, small: bool = False) -> TileConfig | None:
    """The configuration ``load`` builds for these choices; None: no small-tile build for ``fast_accum``."""
    table = ((SMALL_SWIGLU_CONFIGS if swiglu else SMALL_CONFIGS) if small else
             (SWIGLU_CONFIGS if swiglu else CONFIGS))
    return table.get(fast_accum)


def prebuild(configs: list[TileConfig], nvcc: str, include: str, device: int | None = None,
             tester=None) -> list[Path | Exception]:
    """Compile ``configs`` side by side, one nvcc each (about a minute apiece alone): on the 2-core development
    machine six objects took 281 s so against about 60 s each one after another; more cores overlap more (not
    measured). With ``device``, each object's self-test (``self_tested``) runs side by side too, one child each:
    one after another in ``load``, four children took about 16 s of an H200 machine's first build (each imports
    torch). Each result is its object or why it failed (``load`` then finds the objects and verdicts in the cache,
    or reports the failure itself)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(cfg):
        try:
            library = build(cfg, nvcc, include)
            if device is not None:
                self_tested(library, cfg.name, device, tester)
            return library
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            return err

    with ThreadPoolExecutor(max(1, len(configs))) as pool:
        return list(pool.map(one, configs))


def load(fast_accum: bool, nvcc: str, include: str, tester=None, swiglu: bool = False,
         small: bool = False) -> CutlassGroupedFp8:
    """The kernel for ``fast_accum`` (with the SwiGLU epilogue when ``swiglu``; the small-tile build when
    ``small``), built (or found in the cache), self-tested on this device model in a child process (once per
    machine; ``tester`` replaces the child, for tests) and loaded; raises with the reason."""
    cfg = config_of(fast_accum, swiglu, small)
    if cfg is None:
        raise RuntimeError(f"no small-tile build with fast_accum={fast_accum} (cutlass_grouped.SMALL_CONFIGS)")
    library = build(cfg, nvcc, include)
    self_tested(library, cfg.name, torch.cuda.current_device(), tester)
    return CutlassGroupedFp8(library, cfg.name)


def self_tested(library: Path, config: str, device: int, tester=None) -> None:
    """``library``'s ``config`` passed its self-test on ``device``'s model and driver: a file beside the object
    keeps the verdict, else ``tester`` (default ``test_in_child``) runs it now; raises with the reason. The
    object's build lock is held meanwhile, so that the ranks of one host run one test per object, not one each."""
    passed = library.with_name(f"{library.stem}.ok-{device_tag(device)}")

    def test():
        (tester or test_in_child)(library, config, device)
        passed.touch()
    _once_under_lock(library, passed, test)


def device_tag(device: int) -> str:
    """The device model and the driver, as a file-name part: a verdict holds for that pair only."""
    version = ctypes.c_int(0)
    try:
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    except OSError:
        pass
    name = re.sub(r"[^A-Za-z0-9]+", "-", torch.cuda.get_device_name(device)).strip("-")
    major, minor = torch.cuda.get_device_capability(device)
    return f"{name}-sm{major}{minor}-driver{version.value}"


def test_in_child(library: Path, config: str, device: int, timeout_s: float = 300.0) -> None:
    """Run ``self_test`` on ``device`` in a child process; raises with its output when it fails or faults."""
    cmd = [sys.executable, "-m", "omni.platforms.cuda.cutlass_grouped", str(library), config, str(device)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the self-test of {config} did not finish in {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"the self-test of {config} failed in a child process (exit {done.returncode}):\n{tail}")


def swiglu_pairs(p_RN: torch.Tensor) -> torch.Tensor:
    """What the SwiGLU epilogue computes from the fp32 product: ``x1 * silu(x2)`` of each column pair (2j, 2j+1)."""
    x1, x2 = p_RN[:, 0::2], p_RN[:, 1::2]
    return x1 * torch.nn.functional.silu(x2)


def self_test(kernel: CutlassGroupedFp8) -> None:
    """Two small groups on the current device against the fp32 product: an object that cannot run here (another
    driver, another chip) fails at build time, where ``auto`` can still fall back, not in the first request."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(80, 128, device=dev, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(2, 128, 128, device=dev, generator=g).to(torch.float8_e4m3fn)
    offs = torch.tensor([48, 80], dtype=torch.int32, device=dev)
    y = kernel(x, torch.ones(80, device=dev), w, torch.ones(2, 128, device=dev), offs).float()
    ref = torch.cat([x[:48].float() @ w[0].float().T, x[48:].float() @ w[1].float().T])
    ref = swiglu_pairs(ref) if kernel.swiglu else ref
    err = ((y - ref).norm() / ref.norm()).item()  # .item() waits for the kernel: a launch fault surfaces here
    if not err < 1e-2:
        raise RuntimeError(f"{kernel.name}: self-test against the fp32 product failed (relative error {err:.3g})")


def main(argv: list[str]) -> int:
    """``python -m omni.platforms.cuda.cutlass_grouped LIBRARY CONFIG DEVICE``: the child of ``test_in_child``."""
    library, config, device = Path(argv[0]), argv[1], int(argv[2])
    kernel = CutlassGroupedFp8(library, config)  # opening the object needs no device
    torch.cuda.set_device(device)
    self_test(kernel)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
