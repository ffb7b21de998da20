"""``omni-run generate`` with world size 2 launches its ranks and draws the single-process image.

Both runs go through the real CLI in a subprocess on the embedded tiny model
(gloo, two CPU ranks for tp2). tp2 sums row-parallel partial products in
another order, so the final latents agree within fp32 rounding (5e-5: the
trained tiny model's activations are larger than random weights', measured
1.7e-5 at 2 steps) and
the uint8 images within one grey level where a value sits on a rounding edge.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file

from two_ranks import two_rank_recipe

ARGS = ("--prompt", "a red cat on green grass", "--steps", "2", "--seed", "5")


def generate(tmp_path, tag: str, *extra: str) -> tuple[subprocess.CompletedProcess, np.ndarray, object]:
    png, latents = tmp_path / f"{tag}.png", tmp_path / f"{tag}.safetensors"
    proc = subprocess.run([sys.executable, "-m", "omni.cli", "generate", *ARGS, *extra, "-o", str(png),
                           "--latents", str(latents)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, np.asarray(Image.open(png)).astype(np.int16), load_file(str(latents))["latents"]


@pytest.mark.slow  # two full CLI runs with 1024px VAE decodes (~30 s); the layouts' numerics: test_parity.py
@pytest.mark.timeout(900)
def test_tp2_generate_launches_ranks_and_matches_one_process(tmp_path):
    one, image_1, latents_1 = generate(tmp_path, "one")
    two, image_2, latents_2 = generate(tmp_path, "tp2", "--recipe", str(two_rank_recipe(tmp_path, "tp")))
    assert "world 1" in one.stdout and "world 2" in two.stdout, "the tp2 run must launch two ranks"
    assert latents_1.shape == latents_2.shape
    assert (latents_1 - latents_2).abs().max().item() <= 5e-5
    assert image_1.shape == image_2.shape == (128, 128, 3)
    diff = np.abs(image_1 - image_2)
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
