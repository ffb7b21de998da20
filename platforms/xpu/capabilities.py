"""What this Intel GPU and this torch build can do, read once and kept as data.

May assume: ``torch`` is importable; nothing else (``torch.xpu`` is core).
Detection uses ``torch.xpu.is_available`` / ``device_count`` (no device
context). IPEX is found with ``find_spec`` and its version read from package
metadata, without importing it: IPEX releases pin one torch minor version and
refuse to load with another, so a mismatch is a reason, not an import. The
collective backend is XCCL when this torch was built with it (core since
2.7), else oneCCL's ``"ccl"`` when ``oneccl_bindings_for_pytorch`` is installed.
Whether ``_scaled_mm`` runs on XPU is asked of the dispatcher, not guessed
from the version (it is being enabled across torch 2.10-2.16).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist

from omni.specs import PlatformInfo

IPEX = "intel_extension_for_pytorch"
ONECCL = "oneccl_bindings_for_pytorch"
ATTENTION_BACKENDS = ("auto", "varlen", "sdpa")  # varlen = IPEX varlen_attention


@dataclass(frozen=True)
class XpuCaps:
    device_name: str = ""
    ipex: str = ""  # why IPEX cannot be used ("" = usable)
    graphs: bool = False  # torch.xpu.XPUGraph exists (torch >= 2.11)
    scaled_mm: bool = False  # aten::_scaled_mm has an XPU kernel in this torch

    def names(self) -> frozenset[str]:
        flags = {"graphs"} if self.graphs else set()
        return frozenset(flags | ({"fp8"} if self.scaled_mm else set()) | (set() if self.ipex else {"ipex"}))


def _minor(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2])


def ipex_problem() -> str:
    """Why IPEX cannot be used here ("" when it can)."""
    if importlib.util.find_spec(IPEX) is None:
        return f"{IPEX} is not installed"
    try:
        ipex_version = version(IPEX)
    except PackageNotFoundError:  # importable without metadata (a source tree): nothing to compare
        return ""
    if _minor(ipex_version) != _minor(torch.__version__):
        return (f"{IPEX} {ipex_version} targets torch {'.'.join(map(str, _minor(ipex_version)))}, "
                f"this is torch {torch.__version__}")
    return ""


def has_xpu_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "XPU")


def detect_caps(index: int) -> XpuCaps:
    return XpuCaps(device_name=torch.xpu.get_device_properties(index).name, ipex=ipex_problem(),
                   graphs=hasattr(torch.xpu, "XPUGraph"), scaled_mm=has_xpu_kernel("aten::_scaled_mm"))


def load_ipex() -> object | str:
    try:
        return importlib.import_module(IPEX)
    except ImportError as err:
        return f"varlen: importing {IPEX} failed: {err}"


def dist_backend() -> str | None:
    """``"xccl"`` when this torch has it, else ``"ccl"`` when oneCCL's bindings are installed, else None."""
    if dist.is_available() and dist.is_xccl_available():
        return "xccl"
    return "ccl" if importlib.util.find_spec(ONECCL) is not None else None


def platform_info(reject) -> PlatformInfo | None:
    if not torch.xpu.is_available():
        return reject("xpu: torch.xpu.is_available() is False (no Intel GPU visible, no Level Zero driver, "
                      "or a torch without XPU support)")
    flags = {"graphs"} if hasattr(torch.xpu, "XPUGraph") else set()
    return PlatformInfo(name="xpu", device_type="xpu", dist_backend=dist_backend() or "xccl",
                        device_count=torch.xpu.device_count(), device_name="Intel GPU", capabilities=frozenset(flags))


def recipe_problems(recipe) -> list[str]:
    problems = []
    if recipe.attention.backend not in ATTENTION_BACKENDS:
        problems.append(f"xpu: attention.backend={recipe.attention.backend} is not an xpu backend "
                        f"(choose {', '.join(ATTENTION_BACKENDS)})")
    if recipe.parallel.world_size > 1 and dist_backend() is None:
        problems.append(f"xpu: parallel world size {recipe.parallel.world_size} needs XCCL (a torch built with "
                        f"USE_XCCL) or oneCCL ({ONECCL}); neither is available")
    if recipe.graph.mode == "capture" and not hasattr(torch.xpu, "XPUGraph"):
        problems.append("xpu: graph.mode=capture needs torch.xpu.XPUGraph (torch >= 2.11)")
    return problems
