"""The deployment seam: the model registry (entry points), flavour resolution, the frozen Deployment.

Real entry points throughout: the built-in flavours come from this package's
metadata, and the broken one is a real distribution written to a temporary
folder on PYTHONPATH (its module raises at import), run through the CLI.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from omni import model_registry
from omni.deployment import Deployment, DeploymentError, one_replica, prepare
from omni.recipe import RecipeError, load_recipe

BUILTIN = ("hunyuan_image3", "hunyuan_image3_instruct", "hunyuan_image3_instruct_distil",
           "hunyuan_image3_instruct_tiny", "hunyuan_image3_tiny")
from golden_utils import GOLDEN_DIR as GOLDEN


def checkpoint_dir(tmp_path: Path, **config) -> Path:
    """A directory holding only a config.json: all that flavour detection reads."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, **config}))
    return tmp_path


def test_builtin_flavours_register_through_entry_points():
    assert set(BUILTIN) <= set(model_registry.names())
    loaded = {r.name: r for r in model_registry.discover()}
    assert all(loaded[n].flavor is not None and loaded[n].error is None for n in BUILTIN)
    assert all(isinstance(loaded[n].flavor, model_registry.ModelFlavor) for n in BUILTIN)
    assert model_registry.flavor_choices()[0] == "auto"


@pytest.mark.parametrize("config, expected", [
    ({}, "hunyuan_image3"),
    ({"model_version": "HunyuanImage-3.0"}, "hunyuan_image3"),
    ({"model_version": "HunyuanImage-3.0-Instruct"}, "hunyuan_image3_instruct"),
    ({"model_version": "HunyuanImage-3.0-Instruct", "cfg_distilled": True, "use_meanflow": True},
     "hunyuan_image3_instruct_distil"),
])
def test_auto_reads_the_flavour_from_config_json(tmp_path, config, expected):
    assert model_registry.resolve("auto", str(checkpoint_dir(tmp_path, **config))) == expected


@pytest.mark.skipif(not (GOLDEN / "hunyuan_image3_instruct_tiny.json").is_file(), reason="no ../shared/golden")
def test_the_golden_instruct_config_is_the_instruct_flavour(tmp_path):
    tiny = json.loads((GOLDEN / "hunyuan_image3_instruct_tiny.json").read_text())["tiny_config"]
    assert model_registry.resolve("auto", str(checkpoint_dir(tmp_path, **tiny))) == "hunyuan_image3_instruct"


def test_an_explicit_flavour_at_odds_with_its_checkpoint_is_refused(tmp_path):
    path = str(checkpoint_dir(tmp_path, model_version="HunyuanImage-3.0-Instruct"))
    with pytest.raises(model_registry.ModelError, match="model.flavor=hunyuan_image3 but .*config.json describes "
                                                          "hunyuan_image3_instruct"):
        model_registry.resolve("hunyuan_image3", path)


def test_auto_without_a_checkpoint_names_what_to_pass():
    with pytest.raises(model_registry.ModelError, match="pass --model PATH"):
        model_registry.resolve("auto", None)


def test_a_missing_config_json_names_the_file(tmp_path):
    with pytest.raises(model_registry.ModelError, match=r"config.json: cannot read the checkpoint config"):
        model_registry.resolve("auto", str(tmp_path))


def test_the_distil_flavour_refuses_cfg_parallel_naming_both(tmp_path):
    """A CFG-distilled checkpoint has one row per request: cfg parallel has nothing to split."""
    recipe = load_recipe("cpu_tiny_instruct").replace_paths(
        {"model.flavor": "hunyuan_image3_instruct_distil", "parallel.cfg": 2, "device.count": 2})
    with pytest.raises(DeploymentError, match="hunyuan_image3_instruct_distil: parallel.cfg=2 .* set parallel.cfg: 1"):
        prepare(recipe, overrides={"model.path": str(checkpoint_dir(
            tmp_path, model_version="HunyuanImage-3.0-Instruct-Distil", cfg_distilled=True, use_meanflow=True))})


def test_an_unknown_flavour_is_a_recipe_error_naming_the_key():
    with pytest.raises(RecipeError, match="model.flavor: 'sd3' is not allowed; allowed values: auto, hunyuan_image3"):
        load_recipe("cpu_tiny").replace_path("model.flavor", "sd3")


def test_prepare_gives_a_frozen_picklable_final_deployment(tmp_path):
    d = prepare("cpu_tiny", platform="cpu", overrides={"serving.port": 9100})
    assert isinstance(d, Deployment) and d.recipe.platform == "cpu" and d.recipe.serving.port == 9100
    with pytest.raises(AttributeError):
        d.recipe = None  # frozen
    again = pickle.loads(pickle.dumps(d))
    assert again == d and again.recipe.serving.port == 9100
    assert d.platform() is d.platform(), "one Platform per process"
    assert d.flavor().name == "hunyuan_image3_tiny" and d.model_id == "hunyuan_image3_tiny"


def test_prepare_resolves_auto_and_checks_the_model_path(tmp_path):
    with pytest.raises(DeploymentError, match="is not a directory"):
        prepare("cpu_tiny", overrides={"model.path": str(tmp_path / "absent")})
    with pytest.raises(DeploymentError, match=r"recipe cpu_tiny: model.path .*: no model.safetensors.index.json"):
        prepare("cpu_tiny", overrides={"model.path": str(tmp_path)})  # a directory without weights
    assert prepare("cpu_tiny", overrides={"model.path": str(tmp_path)}, random_weights=True), "benches need none"
    auto = load_recipe("cpu_tiny").replace_path("model.flavor", "auto")
    with pytest.raises(DeploymentError, match="model.flavor=auto reads the checkpoint's config.json"):
        prepare(auto)


def test_one_replica_keeps_the_replica_layout_and_drops_dp():
    recipe = load_recipe("cpu_tiny").replace_paths({"parallel.dp": 2, "parallel.tp": 2, "device.count": 4})
    d = one_replica(Deployment(recipe))
    assert (d.recipe.parallel.dp, d.recipe.parallel.tp, d.recipe.device.count, d.world_size) == (1, 2, 2, 2)


# ------------------------------------------------------------------ a real broken entry point


def broken_distribution(root: Path, group: str, name: str) -> Path:
    """A real installed distribution whose ``group`` entry point ``name`` fails at import."""
    info = root / "broken_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = broken_plugin_mod:flavor\n")
    (root / "broken_plugin_mod.py").write_text("raise ImportError('this plugin is broken on purpose')\n")
    return root


def run_cli(env_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(env_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "omni.cli", *argv], capture_output=True, text=True, timeout=300,
                          env=env)


def test_a_broken_model_plugin_is_listed_and_breaks_nothing_else(tmp_path):
    site = broken_distribution(tmp_path / "site", "omni.models", "broken_model")
    listed = run_cli(site, "models")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("broken_model"))
    assert "import failed: ImportError: this plugin is broken on purpose" in row
    assert "hunyuan_image3_tiny" in listed.stdout
    assert run_cli(site, "recipes").returncode == 0
    recipe = tmp_path / "uses_broken.yaml"
    recipe.write_text("platform: cpu\nmodel: {flavor: broken_model}\n")
    refused = run_cli(site, "generate", "--recipe", str(recipe), "--prompt", "x")
    assert refused.returncode == 2 and "model flavor 'broken_model' cannot be loaded: import failed" in refused.stderr


# ------------------------------------------------------------------ the engine handle


def test_every_engine_handle_implements_the_protocol():
    from multiprocessing import Pipe

    from omni.engine_handle import EngineHandle
    from omni.engine_loop import EngineLoop
    from omni.parallel.dp import ReplicaRouter
    from omni.parallel.replica_link import RemoteReplica

    local = EngineLoop(lambda: None)
    remote = RemoteReplica(Pipe()[0])
    router = ReplicaRouter([local, remote])
    for handle in (local, remote, router):
        assert isinstance(handle, EngineHandle), type(handle).__name__
    assert router.job is None, "the launch job is a constructor argument (None: replicas it did not start)"
    assert (local.load(), remote.load(), router.load()) == (0, 0, 0)


def test_a_layout_the_host_cannot_hold_names_its_degrees():
    """generate and serve exit 2 with this line (no single-process fallback) when the devices are missing."""
    from omni.deployment import device_problems
    from omni.specs import PlatformInfo

    one_gpu = PlatformInfo(name="cuda", device_type="cuda", dist_backend="nccl", device_count=1,
                           memory_bytes=141 << 30, device_name="NVIDIA H200")
    tp2 = load_recipe("h200x2_tp2")
    assert device_problems(tp2, one_gpu) == ["device.count=2 (parallel: tp 2) but cuda sees 1 device(s): "
                                             "one process per device"]
    assert device_problems(load_recipe("h200_fp8"), one_gpu) == []


def test_a_refusal_at_build_time_is_a_configuration_error(tmp_path, capsys):
    """The pipeline is built on the engine thread; its refusal still reaches the CLI as itself (exit 2)."""
    from omni.cli import main

    recipe = tmp_path / "cpu_capture.yaml"
    recipe.write_text("platform: cpu\nmodel: {dtype: float32}\ngraph: {mode: capture}\n")
    assert main(["generate", "--recipe", str(recipe), "--prompt", "x", "--steps", "1",
                 "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "omni-run: error: no platform plugin implements attention" in err
    assert "cpu: reference: not capturable (reads sequence lengths on the host)" in err
    assert not (tmp_path / "x.png").exists()
