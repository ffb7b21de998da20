"""What this CUDA machine and this torch build can do, read once and kept as data.

May assume: ``torch`` is importable; nothing else. Reading a ``Caps`` touches
no kernel: ``detect_caps()`` queries device properties (no allocation), looks
for vendor modules with ``find_spec`` and introspects torch signatures; the
FA3 module itself is imported only by ``load_fa3()``, when an attention spec is
resolved. Resolution code takes a ``Caps`` argument, so tests can hand it a
made-up machine (an sm89 card, a torch without ``varlen_attn``) on a CPU box.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch

from omni.specs import PlatformInfo

from .cutlass_grouped import find_cutlass_include, find_nvcc

FA3_MODULES = ("fa3_fwd_interface", "flash_attn_interface")  # probe order, as vllm-omni
_FA3_CONFIGS = {"fa3_fwd_interface": "fa3_fwd_config", "flash_attn_interface": "flash_attn_config"}


@dataclass(frozen=True)
class Caps:
    """One device's capability snapshot plus the torch / vendor features present."""

    sm: tuple[int, int] = (0, 0)
    cuda_version: tuple[int, int] = (0, 0)  # torch.version.cuda
    fa3_module: str | None = None  # importable FA3 interface module name (found, not imported)
    varlen_params: frozenset[str] = frozenset()  # keyword names of torch varlen_attn; empty = absent
    has_flex: bool = False
    has_scaled_mm: bool = False
    has_grouped_mm: bool = False
    has_scaled_grouped_mm: bool = False
    has_mm_out_dtype: bool = False  # aten::mm.dtype: bf16 x bf16 -> fp32 output
    nvcc: str | None = None  # the CUDA compiler that builds our CUTLASS kernels (found, not run)
    cutlass_include: str | None = None  # CUTLASS's headers (the nvidia-cutlass package of the ``cuda`` extra)

    @property
    def sm_name(self) -> str:
        return f"sm{self.sm[0]}{self.sm[1]}"

    @property
    def fp8(self) -> bool:
        return self.sm >= (8, 9) and self.has_scaled_mm

    @property
    def cutlass_grouped_refusal(self) -> str | None:
        """Why our CUTLASS grouped fp8 kernel cannot be built here (None: it can: sm90, nvcc, headers)."""
        if self.sm != (9, 0):
            return f"the CUTLASS grouped fp8 kernel is built for sm90a (Hopper), this device is {self.sm_name}"
        if self.nvcc is None:
            return "the CUTLASS grouped fp8 kernel needs nvcc (set CUDA_HOME or put nvcc on PATH)"
        if self.cutlass_include is None:
            return ("the CUTLASS grouped fp8 kernel needs CUTLASS's headers: pip install 'omni-run[cuda]' "
                    "(nvidia-cutlass), or set OMNI_CUTLASS_INCLUDE")
        return None

    @property
    def varlen(self) -> bool:
        return bool(self.varlen_params)

    @property
    def native_paged(self) -> bool:
        """A kernel that reads a paged pool itself (no gather): varlen with block_table."""
        return "block_table" in self.varlen_params and "seqused_k" in self.varlen_params

    def names(self) -> frozenset[str]:
        """Capability flags for ``PlatformInfo.capabilities``."""
        flags = {"graphs"}
        # cuDNN's tensor-core convolutions are NHWC kernels from sm70 on; the gain is measured on the H200 only
        flags |= {"channels_last"} if self.sm >= (7, 0) else set()
        flags |= {"fp8"} if self.fp8 else set()
        flags |= {"paged_kv"} if self.native_paged else set()
        flags |= {"fa3"} if self.fa3_module and self.sm[0] == 9 else set()
        flags |= {"varlen"} if self.varlen else set()
        flags |= {"flex"} if self.has_flex else set()
        flags |= {"grouped_mm"} if self.has_grouped_mm else set()
        flags |= {"cutlass_grouped"} if self.cutlass_grouped_refusal is None else set()  # kernels.grouped_fp8
        return frozenset(flags)


def _version_tuple(text: str | None) -> tuple[int, int]:
    if not text:
        return (0, 0)
    major, minor = (text.split(".") + ["0"])[:2]
    return (int(major), int(minor))


def varlen_params() -> frozenset[str]:
    """Parameter names of ``torch.nn.attention.varlen.varlen_attn`` (empty when absent)."""
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return frozenset()
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def find_fa3() -> str | None:
    """Name of the first FA3 interface module that is installed (not imported)."""
    return next((m for m in FA3_MODULES if importlib.util.find_spec(m) is not None), None)


def detect_caps(device_index: int = 0) -> Caps:
    """Snapshot of device ``device_index``; needs ``torch.cuda.is_available()``."""
    props = torch.cuda.get_device_properties(device_index)
    return Caps(
        sm=(props.major, props.minor),
        cuda_version=_version_tuple(torch.version.cuda),
        fa3_module=find_fa3(),
        varlen_params=varlen_params(),
        has_flex=importlib.util.find_spec("torch.nn.attention.flex_attention") is not None,
        has_scaled_mm=hasattr(torch, "_scaled_mm"),
        has_grouped_mm=hasattr(torch, "_grouped_mm"),
        has_scaled_grouped_mm=hasattr(torch, "_scaled_grouped_mm"),
        has_mm_out_dtype="dtype" in torch.ops.aten.mm.overloads(),
        nvcc=find_nvcc(),
        cutlass_include=find_cutlass_include(),
    )


@dataclass(frozen=True)
class Fa3:
    """An imported FA3 interface and what its build supports."""

    module: object
    name: str
    fp16: bool = True
    paged: bool = True
    head_dims: tuple[int, ...] = (64, 96, 128, 192, 256)
    fp8: bool = True  # e4m3 q/k/v with descales (FLASHATTENTION_DISABLE_FP8 unset)
    fwd: object = None  # the build's registered ``fwd`` op (``fa3_raw_fwd``), called without the Python wrappers


# The keywords Fa3Attention passes to the registered op; its schema must name every one of them.
FA3_FWD_KEYWORDS = frozenset({
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "max_seqlen_q", "max_seqlen_k", "page_table",
    "q_descale", "k_descale", "v_descale", "softmax_scale", "is_causal", "num_splits", "pack_gqa"})


def triton_found() -> bool:
    """Whether Triton imports here (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def runs_triton(memory_bound: str, found: bool, reject, refusal: str) -> bool | None:
    """Whether ``kernels.memory_bound`` runs the Triton kernels, Triton importing here or not (``found``):
    ``auto`` where found, ``torch`` never, ``triton`` where found, else None after ``reject(refusal)``."""
    if memory_bound == "torch" or (memory_bound == "auto" and not found):
        return False
    return True if found else reject(refusal)


def fa3_raw_fwd(module) -> object:
    """The ``torch.ops`` overload behind ``module``'s wrappers when its schema takes ``FA3_FWD_KEYWORDS``.

    Why: the wrappers go through a ``torch.library.custom_op``, whose first call
    imports ``torch._dynamo`` (with sympy): 1.1 s on the development CPU, about
    3.4 s of the warm-up on an H100 whose torch had no bytecode caches
    (BENCHMARKS.md, fortieth session). The registered op is the same kernel
    launch. None (use the wrappers) for builds whose op is not registered with
    torch or names its arguments otherwise.
    """
    for value in vars(module).values():
        if isinstance(value, torch._ops._OpNamespace) and hasattr(value, "fwd"):
            op = getattr(value.fwd, "default", None)
            names = {a.name for a in op._schema.arguments} if op is not None else set()
            return op if FA3_FWD_KEYWORDS <= names else None
    return None


def load_fa3(name: str) -> Fa3 | str:
    """Import FA3 module ``name``; a reason string when it cannot be used."""
    try:
        module = importlib.import_module(name)
    except (ImportError, OSError, RuntimeError) as err:  # a broken vendor build is a reason, not a crash
        return f"fa3: importing {name} failed: {type(err).__name__}: {err}"
    flags = _fa3_build_flags(name)
    dims = tuple(d for d in (64, 96, 128, 192, 256) if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}", False))
    return Fa3(module, name, fp16=not flags.get("FLASHATTENTION_DISABLE_FP16", False),
               paged=not flags.get("FLASHATTENTION_DISABLE_PAGEDKV", False), head_dims=dims,
               fp8=not flags.get("FLASHATTENTION_DISABLE_FP8", False), fwd=fa3_raw_fwd(module))


def _fa3_build_flags(name: str) -> dict:
    config = _FA3_CONFIGS.get(name)
    if config is None or importlib.util.find_spec(config) is None:
        return {}  # full upstream build: every feature compiled in
    return dict(importlib.import_module(config).CONFIG.get("build_flags", {}))


def platform_info(reject) -> PlatformInfo | None:
    """Cheap detection: device count and properties only, no allocation, no vendor import."""
    if torch.version.hip is not None:
        return reject(f"cuda: this torch is a ROCm build (torch.version.hip={torch.version.hip}); use --platform rocm")
    if torch.version.cuda is None:
        return reject("cuda: this torch was built without CUDA (torch.version.cuda is None)")
    if not torch.cuda.is_available():
        return reject("cuda: torch.cuda.is_available() is False (no NVIDIA driver or no visible device)")
    props = torch.cuda.get_device_properties(0)
    return PlatformInfo(name="cuda", device_type="cuda", dist_backend="nccl",
                        device_count=torch.cuda.device_count(), device_name=props.name,
                        memory_bytes=props.total_memory, capabilities=detect_caps(0).names())


def recipe_problems(recipe) -> list[str]:
    """Static reasons this platform refuses ``recipe``: block-scaled ``quant.scheme`` below sm100.

    Reads device 0's compute capability (a property query, as detection does);
    every other limit is checked per spec at resolution.
    """
    from .gemm import block_scaled_refusal

    scheme = getattr(getattr(recipe, "quant", None), "scheme", "none")
    if scheme == "none" or not torch.cuda.is_available():
        return []
    reason = block_scaled_refusal(scheme, torch.cuda.get_device_capability(0))
    return [reason] if reason else []


@functools.lru_cache(maxsize=None)
def log_once(message: str) -> None:
    """An INFO line once per process: a fast path this machine lacks, and how to get it (the trace logs the rest)."""
    logging.getLogger("omni.platforms").info(message)
