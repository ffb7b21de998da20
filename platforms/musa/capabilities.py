"""What this Moore Threads GPU and the installed torch_musa can do, kept as data.

May assume: ``torch`` is importable; nothing else. ``torch.musa`` exists
once ``torch_musa`` is imported (torch's backend autoload does it at
``import torch`` when installed, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
``platform_info`` imports it only when ``find_spec`` finds it and turns an
``ImportError`` (MUSA SDK libraries missing) into a reason; any other
exception propagates. ``is_available`` / ``device_count`` create no device
context; the compute capability is read by ``detect_caps`` on a worker.
MCCL is torch_musa's collective backend; S80/S3000 builds ship without it.
The vendor FlashAttention is the ``flash_attn_interface`` module of Moore
Threads' build (FA3 interface; package identity unverified upstream), found
with ``find_spec`` and imported at resolution.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omni.specs import PlatformInfo

FLASH_MODULE = "flash_attn_interface"
FLASH_MIN_CC = (3, 1)  # vllm-omni's gate for the vendor flash kernels (S5000-class)
ATTENTION_BACKENDS = ("auto", "fa3", "sdpa")  # fa3 = the vendor's FA3-interface build


@dataclass(frozen=True)
class MusaCaps:
    cc: tuple[int, int] = (0, 0)  # torch.musa.get_device_capability()
    flash_installed: bool = False  # flash_attn_interface found (not imported)
    graphs: bool = False  # torch.musa.MUSAGraph exists

    def names(self) -> frozenset[str]:
        flags = {"graphs"} if self.graphs else set()
        return frozenset(flags | ({"flash"} if self.flash_installed and self.cc >= FLASH_MIN_CC else set()))


def detect_caps(index: int) -> MusaCaps:
    return MusaCaps(cc=tuple(torch.musa.get_device_capability(index)),
                    flash_installed=importlib.util.find_spec(FLASH_MODULE) is not None,
                    graphs=hasattr(torch.musa, "MUSAGraph"))


def load_module(name: str, what: str) -> object | str:
    """Import a vendor module; a reason string when it cannot be used."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        return f"{what}: importing {name} failed: {err}"


def has_mccl() -> bool:
    return dist.is_available() and dist.is_backend_available("mccl")


def platform_info(reject) -> PlatformInfo | None:
    if importlib.util.find_spec("torch_musa") is None:
        return reject("musa: torch_musa is not installed (Moore Threads ships it as GitHub release wheels)")
    torch_musa = load_module("torch_musa", "musa")
    if isinstance(torch_musa, str):
        return reject(f"{torch_musa} (is the MUSA SDK on the library path?)")
    if not torch.musa.is_available():
        return reject("musa: torch.musa.is_available() is False (no Moore Threads GPU visible)")
    flags = ({"graphs"} if hasattr(torch.musa, "MUSAGraph") else set()) | ({"mccl"} if has_mccl() else set())
    return PlatformInfo(name="musa", device_type="musa", dist_backend="mccl", device_count=torch.musa.device_count(),
                        device_name="Moore Threads GPU", capabilities=frozenset(flags))


def recipe_problems(recipe) -> list[str]:
    problems, backend = [], recipe.attention.backend
    if backend not in ATTENTION_BACKENDS:
        problems.append(f"musa: attention.backend={backend} is not a musa backend "
                        f"(choose {', '.join(ATTENTION_BACKENDS)})")
    if backend == "fa3" and recipe.kv_cache.mode == "paged":
        problems.append("musa: paged KV unsupported by the vendor flash attention (attention.backend=fa3 with "
                        "kv_cache.mode=paged); use kv_cache.mode=contiguous or attention.backend=sdpa")
    if recipe.parallel.world_size > 1 and not has_mccl():
        problems.append(f"musa: parallel world size {recipe.parallel.world_size} needs MCCL; this torch_musa build "
                        f"has none (S80/S3000 builds ship with USE_MCCL=0)")
    if recipe.graph.mode == "capture" and not hasattr(torch.musa, "MUSAGraph"):
        problems.append("musa: graph.mode=capture needs torch.musa.MUSAGraph")
    return problems
