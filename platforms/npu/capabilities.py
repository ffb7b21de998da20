"""What this Ascend machine and the installed torch_npu can do, kept as data.

May assume: ``torch`` is importable; nothing else. ``torch.npu`` exists only
once ``torch_npu`` is imported: torch's backend autoload imports it at
``import torch`` when it is installed, unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``.
``platform_info`` therefore imports it only when ``find_spec`` finds it (the
same import torch's autoload would have done) and turns an ``ImportError``
(``libhccl.so`` missing: CANN's ``set_env.sh`` not sourced) into a reason;
any other exception propagates. ``is_available`` / ``device_count`` create no
device context; the SoC name is read by ``detect_caps`` on a worker whose
device is set.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

import torch

from omni.specs import PlatformInfo

FIA_SOCS = ("Ascend910B", "Ascend910_93", "Ascend950")  # Atlas A2, A3, 950: FIA (npu_fused_infer_attention_score)
ATTENTION_BACKENDS = ("auto", "fia", "sdpa")


@dataclass(frozen=True)
class NpuCaps:
    """One device's capability snapshot."""

    soc: str = ""  # torch.npu.get_device_name(), e.g. "Ascend910B2"
    graphs: bool = False  # torch.npu.NPUGraph exists (torch_npu >= 2.6)

    @property
    def fia(self) -> bool:
        return self.soc.startswith(FIA_SOCS)

    def names(self) -> frozenset[str]:
        return frozenset({"graphs"} if self.graphs else set()) | ({"fia", "paged_kv"} if self.fia else set())


def detect_caps(index: int) -> NpuCaps:
    return NpuCaps(soc=torch.npu.get_device_name(index), graphs=hasattr(torch.npu, "NPUGraph"))


def load_torch_npu() -> object | str:
    """Import torch_npu; a reason string when it cannot be used."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as err:
        return f"npu: importing torch_npu failed: {err} (is the CANN toolkit's set_env.sh sourced?)"


def platform_info(reject) -> PlatformInfo | None:
    """Detection without a device context: installed, importable, devices visible."""
    if importlib.util.find_spec("torch_npu") is None:
        return reject("npu: torch_npu is not installed")
    torch_npu = load_torch_npu()
    if isinstance(torch_npu, str):
        return reject(torch_npu)
    if not torch.npu.is_available():
        return reject("npu: torch.npu.is_available() is False (no Ascend device visible; "
                      "check ASCEND_RT_VISIBLE_DEVICES and the driver)")
    flags = {"graphs"} if hasattr(torch.npu, "NPUGraph") else set()
    return PlatformInfo(name="npu", device_type="npu", dist_backend="hccl", device_count=torch.npu.device_count(),
                        device_name="Ascend NPU", capabilities=frozenset(flags))


def recipe_problems(recipe) -> list[str]:
    """Static reasons this platform refuses ``recipe`` (torch_npu loaded by detection; no device needed)."""
    problems = []
    backend, page = recipe.attention.backend, recipe.kv_cache.page_tokens
    if backend not in ATTENTION_BACKENDS:
        problems.append(f"npu: attention.backend={backend} is not an npu backend "
                        f"(choose {', '.join(ATTENTION_BACKENDS)})")
    if backend == "fia" and recipe.kv_cache.mode == "paged" and (page % 128 or not 128 <= page <= 512):
        problems.append(f"npu: attention.backend=fia with kv_cache.page_tokens={page}: FIA paged KV needs "
                        f"a multiple of 128 in 128..512")
    if recipe.graph.mode == "capture" and not hasattr(torch.npu, "NPUGraph"):
        problems.append("npu: graph.mode=capture needs torch.npu.NPUGraph (torch_npu >= 2.6)")
    return problems
