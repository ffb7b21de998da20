"""cpu_tiny on two CPU ranks: the recipe file the multi-rank tests launch (embedded weights, no download)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

SINGLE_RANK = "parallel: {tp: 1, ep: 1, ulysses: 1, ring: 1, cfg: 1, dp: 1}"


def two_rank_recipe(tmp_path: Path, degree: str) -> Path:
    """cpu_tiny with ``degree`` (tp, cfg, dp, ...) 2 on two CPU devices, written as ``cpux2_<degree>2.yaml``."""
    text = resources.files("omni.recipes").joinpath("cpu_tiny.yaml").read_text()
    assert SINGLE_RANK in text and "count: 1" in text, "cpu_tiny.yaml changed its layout lines"
    name = f"cpux2_{degree}2"
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace(SINGLE_RANK, f"parallel: {{{degree}: 2}}").replace("count: 1", "count: 2")
                    .replace("name: cpu_tiny", f"name: {name}"))
    return path
