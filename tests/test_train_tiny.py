"""The tiny training script: a resumed run equals an unbroken one, and what it exports the engine loads.

Small settings (2 steps of 4 rows, one thread) on the CPU: the claims under
test are the script's (deterministic from the seed, resumable at any saved
step, the checkpoint in the layout ``build_pipeline`` reads), not the
quality of the shipped weights (tests/test_quality_tiny*.py gate those).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from omni.models.hunyuan_image3.train_tiny.__main__ import main

SMALL = ["--steps", "2", "--batch", "4", "--group", "2", "--save-every", "1", "--threads", "1"]


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _weights(run, part: str) -> dict:
    return load_file(str(run / "state" / f"{part}.safetensors"))


@pytest.mark.parametrize("model,part", [("instruct", "edit"), ("base", "dit")])
def test_a_resumed_run_equals_an_unbroken_one(tmp_path, model, part):
    phase = ["--phase", "dit"]
    main(["--model", model, "--out", str(tmp_path / "whole"), *phase, *SMALL])
    small = SMALL.copy()
    small[1] = "1"  # stop after step 1 ...
    main(["--model", model, "--out", str(tmp_path / "split"), *phase, *small])
    main(["--model", model, "--out", str(tmp_path / "split"), *phase, *SMALL, "--resume"])  # ... and go on
    whole, split = _weights(tmp_path / "whole", part), _weights(tmp_path / "split", part)
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[k], split[k]) for k in whole)
    fresh = _weights(tmp_path / "whole", part)
    assert any(not torch.equal(fresh[k], v) for k, v in _initial(model).items() if k in fresh), "nothing trained"


def _initial(model: str) -> dict:
    """The weights a run starts from (its step-0 module)."""
    import argparse

    from omni.models.hunyuan_image3.train_tiny.__main__ import parse_args

    args: argparse.Namespace = parse_args(["--model", model, "--out", "unused", *SMALL])
    if model == "instruct":
        from omni.models.hunyuan_image3.train_tiny.instruct import InstructTrainer

        return {k: v.clone() for k, v in InstructTrainer(args).trainable.state_dict().items()}
    from omni.models.hunyuan_image3.train_tiny.train import Trainer

    return {k: v.clone() for k, v in Trainer(args).model.state_dict().items()}


def test_the_instruct_export_edits_through_the_engine(tmp_path):
    """The exported Instruct checkpoint is found Instruct by its config and edits a reference image."""
    from omni.engine_loop import EngineLoop
    from omni.models.hunyuan_image3.build import build_pipeline
    from omni.models.hunyuan_image3.train_tiny import edits
    from omni.platform_manager import select
    from omni.recipe import load_recipe
    from omni.request import ImageRequest
    from omni.scheduler import Scheduler

    main(["--model", "instruct", "--out", str(tmp_path), *SMALL])  # phase all: train, then export
    ckpt = tmp_path / "checkpoint"
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= {p.name for p in ckpt.iterdir()}
    recipe = load_recipe("cpu_tiny_instruct").replace_paths({"model.path": str(ckpt)})
    engine = EngineLoop.around(Scheduler.from_recipe(build_pipeline(recipe, select("cpu"), progress=False),
                                                     recipe)).start()
    try:
        assert engine.wait_ready(30)
        src = edits.to_uint8(edits.render_pair(edits.held_edit(*edits.EDIT_HELD[0]), None)[0])
        [ticket] = engine.submit_many([ImageRequest(prompt="make the circle green", images=(src,), height=256,
                                                    width=256, steps=2, seed=0, template="instruct")])
        image = np.asarray(ticket.result().image_HW3)
    finally:
        engine.stop()
    assert image.shape == (256, 256, 3) and image.dtype == np.uint8
