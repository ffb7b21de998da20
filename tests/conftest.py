"""Shared fixtures: the golden data of ../shared/golden (official HunyuanImage-3.0 outputs)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "shared" / "golden"


@pytest.fixture(scope="session")
def golden_data():
    """(json description, golden tensors without the ``golden.`` prefix, model weights)."""
    js, st = GOLDEN_DIR / "hunyuan_image3_tiny.json", GOLDEN_DIR / "hunyuan_image3_tiny.safetensors"
    if not (js.is_file() and st.is_file()):
        pytest.skip(f"golden data not found in {GOLDEN_DIR} (expected ../shared/golden beside the repo)")
    from safetensors.torch import load_file

    tensors = load_file(str(st))
    g = {k.removeprefix("golden."): v for k, v in tensors.items() if k.startswith("golden.")}
    w = {k: v for k, v in tensors.items() if not k.startswith("golden.")}
    return json.loads(js.read_text()), g, w


@pytest.fixture
def one_cpu_thread():
    """Tiny tensors: one intra-op thread beats two fighting a busy box (grids opt in with an autouse wrapper)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
