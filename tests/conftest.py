"""Shared fixtures: the golden data of ../shared/golden, or of ``OMNI_GOLDEN_DIR`` (official HunyuanImage-3.0
outputs; see golden_utils.GOLDEN_DIR)."""
from __future__ import annotations

import json

import pytest
import torch

from golden_utils import GOLDEN_DIR


def load_golden(stem: str) -> tuple[dict, dict]:
    """(json description, every stored tensor) of ``../shared/golden/<stem>.*``; skips the test when absent."""
    js, st = GOLDEN_DIR / f"{stem}.json", GOLDEN_DIR / f"{stem}.safetensors"
    if not (js.is_file() and st.is_file()):
        pytest.skip(f"golden data {stem} not found in {GOLDEN_DIR} (expected ../shared/golden beside the repo, "
                    "or set OMNI_GOLDEN_DIR)")
    from safetensors.torch import load_file

    return json.loads(js.read_text()), load_file(str(st))


@pytest.fixture(scope="session")
def instruct_golden():
    """The Instruct-era set: (json description, every stored tensor, ``golden.`` names included)."""
    return load_golden("hunyuan_image3_instruct_tiny")


@pytest.fixture(scope="session")
def instruct_g(instruct_golden):
    """(json description, the golden tensors with their ``golden.`` prefix removed) of the Instruct-era set."""
    meta, t = instruct_golden
    return meta, {k.removeprefix("golden."): v for k, v in t.items() if k.startswith("golden.")}


@pytest.fixture(scope="session")
def instruct_checkpoint(instruct_golden, tmp_path_factory):
    """The Instruct golden weights written once as an HF-format checkpoint directory."""
    from golden_utils import write_instruct_checkpoint

    return write_instruct_checkpoint(*instruct_golden, tmp_path_factory.mktemp("instruct_golden_ckpt"))


@pytest.fixture(scope="session")
def golden_data():
    """The base-era set: (json description, golden tensors without the ``golden.`` prefix, model weights)."""
    description, tensors = load_golden("hunyuan_image3_tiny")
    g = {k.removeprefix("golden."): v for k, v in tensors.items() if k.startswith("golden.")}
    w = {k: v for k, v in tensors.items() if not k.startswith("golden.")}
    return description, g, w


@pytest.fixture
def one_cpu_thread():
    """Tiny tensors: one intra-op thread beats two fighting a busy box (grids opt in with an autouse wrapper)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
