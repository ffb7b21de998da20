"""What this ROCm machine and this torch build can do, read once and kept as data.

May assume: ``torch`` is importable; nothing else. ROCm presents itself to
torch as CUDA: device type ``"cuda"``, module ``torch.cuda``, and
``torch.version.hip`` set (None on every other build).

Detection (``platform_info``) reads the build and the device count only:
``torch.cuda.get_device_properties`` and ``current_device`` run torch's lazy
device initialisation, so the architecture (``gcnArchName``) is read by
``detect_caps`` when the first spec is resolved on a worker whose device is
set. ``aiter`` is looked up with ``find_spec`` here and imported by
``load_aiter`` at resolution: importing it JIT-probes the ROCm install and
raises ``RuntimeError("ROCm version file not found")`` without one.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from omni.specs import PlatformInfo

AITER_ARCHS = ("gfx942", "gfx950")  # MI300X/MI325X and MI350X/MI355X: vllm-omni's gate for aiter flash attention
FNUZ_ARCHS = ("gfx942",)  # MI300-class FP8 is float8_e4m3fnuz; gfx950 and RDNA4 use OCP float8_e4m3fn
FP8_ARCHS = ("gfx942", "gfx950", "gfx1200", "gfx1201")  # torch._scaled_mm on ROCm (tensor-wise and row-wise)


@dataclass(frozen=True)
class RocmCaps:
    """One device's capability snapshot plus the torch / vendor features present."""

    arch: str = ""  # gcnArchName without feature suffixes, e.g. "gfx942"
    aiter_installed: bool = False  # aiter found on the path (not imported)
    has_scaled_mm: bool = False

    @property
    def fp8_dtype(self) -> torch.dtype | None:
        if self.arch not in FP8_ARCHS:
            return None
        return torch.float8_e4m3fnuz if self.arch in FNUZ_ARCHS else torch.float8_e4m3fn

    def names(self) -> frozenset[str]:
        flags = {"graphs"}
        flags |= {"fp8"} if self.fp8_dtype is not None and self.has_scaled_mm else set()
        flags |= {"aiter"} if self.aiter_installed and self.arch in AITER_ARCHS else set()
        return frozenset(flags)


def aiter_installed() -> bool:
    return importlib.util.find_spec("aiter") is not None


def detect_caps(index: int) -> RocmCaps:
    """Read device ``index`` (on a worker: this initialises the HIP runtime, which is fine there)."""
    arch = torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
    return RocmCaps(arch=arch, aiter_installed=aiter_installed(), has_scaled_mm=hasattr(torch, "_scaled_mm"))


def load_aiter() -> object | str:
    """Import aiter; a reason string when it cannot be used."""
    try:
        return importlib.import_module("aiter")
    except ImportError as err:
        return f"aiter: importing aiter failed: {err}"
    except RuntimeError as err:  # documented: aiter's JIT builder probes the ROCm install at import
        return f"aiter: importing aiter failed (its JIT builder probes the ROCm install): {err}"


def platform_info(reject) -> PlatformInfo | None:
    """Cheap detection: the build and the device count; no device context, no vendor import."""
    if torch.version.hip is None:
        return reject("rocm: this torch is not a ROCm build (torch.version.hip is None)")
    count = torch.cuda.device_count()
    if count == 0:
        return reject("rocm: no AMD GPU visible (torch.cuda.device_count() == 0; check HIP_VISIBLE_DEVICES)")
    flags = {"graphs"} | ({"aiter"} if aiter_installed() else set())
    return PlatformInfo(name="rocm", device_type="cuda", dist_backend="nccl", device_count=count,
                        device_name=f"AMD GPU (HIP {torch.version.hip})", capabilities=frozenset(flags))


ATTENTION_BACKENDS = ("auto", "aiter", "sdpa")


def recipe_problems(recipe) -> list[str]:
    """Static reasons this platform refuses ``recipe`` (no device needed)."""
    problems = []
    if recipe.attention.backend not in ATTENTION_BACKENDS:
        problems.append(f"rocm: attention.backend={recipe.attention.backend} is not a rocm backend "
                        f"(choose {', '.join(ATTENTION_BACKENDS)})")
    return problems
