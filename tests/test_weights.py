"""Loading HF-format safetensors checkpoints: shards + index, dtype conversion, clear errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from omni.build_options import BuildOptions
from omni.platform_manager import select
from omni.weights import (
    CheckpointError, LoadTarget, StreamingLoad, checkpoint_files, load_checkpoint, materialize_meta_,
)
from omni.models.hunyuan_image3.config import HunyuanImage3Config
from omni.models.hunyuan_image3.tiny import write_tiny_checkpoint
from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
from omni.models.hunyuan_image3.vae import AutoencoderKLConv3D, VAEConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


def fresh(ckpt, dtype=torch.float32):
    cfg = HunyuanImage3Config.from_file(ckpt / "config.json")
    model = HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=dtype))
    vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae))
    return model, vae, [LoadTarget("", model, model.param_name_for), LoadTarget("vae.", vae)]


def test_sharded_checkpoint_loads_every_tensor(ckpt):
    files = checkpoint_files(ckpt)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    model, vae, targets = fresh(ckpt)
    load_checkpoint(ckpt, targets, progress=False)
    with safe_open(str(files[0]), "pt") as f:
        want = f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight")
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj.weight[3], want)


def test_dtype_is_converted_on_load(ckpt):
    model, _, targets = fresh(ckpt, dtype=torch.bfloat16)
    load_checkpoint(ckpt, targets, progress=False)
    assert model.model.wte.weight.dtype == torch.bfloat16


def edited_copy(ckpt, tmp_path, edit):
    """A single-file copy of the checkpoint with ``edit(tensors)`` applied."""
    tensors = {}
    for f in checkpoint_files(ckpt):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    return tmp_path


def test_errors_name_missing_unexpected_and_misshaped_keys(ckpt, tmp_path):
    def edit(t):
        del t["lm_head.weight"]
        del t["model.layers.0.mlp.experts.2.gate_and_up_proj.weight"]
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        t["model.ln_f.weight"] = torch.zeros(7)

    bad = edited_copy(ckpt, tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(bad, fresh(ckpt)[2], progress=False)
    msg = str(err.value)
    assert "missing lm_head.weight" in msg
    assert "missing model.layers.0.mlp.experts.gate_and_up_proj.weight entries [2]" in msg
    assert "unexpected model.layers.0.self_attn.extra.weight" in msg
    assert "model.ln_f.weight: checkpoint (7,) vs model (64,)" in msg


def test_a_rank_s_part_that_does_not_fit_its_shard_is_named(ckpt):
    """A tensor-parallel target reads its part by slicing the file's tensor; a part of the wrong shape is an
    error naming the key and both shapes, beside the other keys' load."""
    model, vae, targets = fresh(ckpt)

    def read(name, part):
        return part[:3] if name == "model.ln_f.weight" else part[:]

    targets[0] = LoadTarget("", model, model.param_name_for, read)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ckpt, targets, progress=False)
    assert "model.ln_f.weight: this rank's part (3,) vs sharded model (64,)" in str(err.value)
    assert str(err.value).count("this rank's part") == 1


def test_index_names_the_shards(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in checkpoint_files(ckpt)}


def test_directory_without_safetensors_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="only safetensors"):
        checkpoint_files(tmp_path)


def test_an_index_naming_shards_that_are_not_there_is_refused_naming_them(ckpt, tmp_path):
    """A partial download: the index is there, a shard is not. Refused before any tensor is read."""
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(ckpt, partial)
    shards = sorted(partial.glob("*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=rf"names 1 of its {len(shards)} shards that are not there "
                                              rf"\({shards[-1].name}\): an interrupted download"):
        checkpoint_files(partial)


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', '{"weight_map": [1, 2]}'])
def test_an_index_that_is_not_one_is_refused_naming_the_file(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors index"):
        checkpoint_files(tmp_path)


def meta_model(ckpt):
    cfg = HunyuanImage3Config.from_file(ckpt / "config.json")
    with torch.device("meta"):
        model = HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=torch.float32))
        vae = AutoencoderKLConv3D(VAEConfig.from_dict(cfg.vae))
    return model, vae, [LoadTarget("", model, model.param_name_for), LoadTarget("vae.", vae)]


def test_streaming_load_part_by_part_equals_one_pass(ckpt):
    whole, whole_vae, targets = fresh(ckpt)
    load_checkpoint(ckpt, targets, progress=False)
    model, vae, targets = meta_model(ckpt)
    stream = StreamingLoad(ckpt, targets)
    for i, layer in enumerate(model.model.layers):
        assert materialize_meta_(layer, "cpu") > 0
        assert stream.load(lambda k, p=f"model.layers.{i}.": k.startswith(p)) > 0
        assert all(p.is_meta for later in model.model.layers[i + 1:] for p in later.parameters())
    materialize_meta_(model, "cpu")
    materialize_meta_(vae, "cpu")
    assert materialize_meta_(model, "cpu") == 0  # parts materialized before are kept, not re-made
    stream.finish()
    for (name, got), want in zip(model.state_dict().items(), whole.state_dict().values()):
        assert torch.equal(got, want), name


def test_streaming_load_reports_parts_never_materialized_and_missing_keys(ckpt, tmp_path):
    bad = edited_copy(ckpt, tmp_path, lambda t: t.pop("lm_head.weight"))
    model, vae, targets = meta_model(ckpt)
    stream = StreamingLoad(bad, targets)
    materialize_meta_(model.model.layers[0], "cpu")
    stream.load(lambda k: k.startswith("model.layers.0."))
    with pytest.raises(CheckpointError) as err:
        stream.finish()  # nothing else was materialized: every other key has nowhere to go
    msg = str(err.value)
    assert "model.layers.1.self_attn.o_proj.weight: its part of the model was never materialized" in msg
    assert "missing lm_head.weight" in msg
