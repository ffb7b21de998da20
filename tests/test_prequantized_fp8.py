"""Pre-quantized FP8 checkpoints (ModelOpt names) load into the fp8 layers as they are; NVFP4/MXFP8 refuse.

A tiny transformer's weights are quantized here the ModelOpt way (``weight`` in
float8_e4m3fn, ``weight_scale`` fp32 per tensor or per output channel,
``input_scale`` a static activation scale; per expert for the routed experts)
and written to a safetensors file with ``hf_quant_config.json``. Loaded through
``omni.weights`` after ``prepare_prequantized()``, the model must hold exactly
the file's e4m3 bytes and scales, and compute what an online-quantized model of
the dequantized weights computes.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omni import quant
from omni.build_options import BuildOptions
from omni.layers import GroupedLinear, Linear
from omni.platform_manager import select
from omni.weights import LoadTarget, load_checkpoint

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def cfg():
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.tiny import ensure_tiny_checkpoint

    return HunyuanImage3Config.from_file(ensure_tiny_checkpoint() / "config.json")


def build(cfg, scheme, dtype=torch.float32):
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer

    return HunyuanImage3Transformer(cfg, select("cpu"), BuildOptions(dtype=dtype, quant=scheme))


def source_weights(cfg) -> dict[str, torch.Tensor]:
    """Official-name bf16 weights of a random tiny model."""
    m = build(cfg, "none")
    g = torch.Generator().manual_seed(0)
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() > 1 else 1.0))
    out = {}
    for name in m.official_names():
        pname, idx = m.param_name_for(name)
        t = m.get_parameter(pname).data
        out[name] = (t if idx is None else t[idx]).clone()
    return out


def modelopt_checkpoint(cfg, path, per_channel: bool, drop_scale_of: str | None = None):
    """Quantize every weight of an fp8 layer the ModelOpt way; returns (tensors, dequantized weights)."""
    target = build(cfg, "fp8_row")
    tensors, dequant = {}, {}
    for name, w in source_weights(cfg).items():
        pname, _ = target.param_name_for(name)
        owner = target.get_submodule(pname.rpartition(".")[0])
        if not (isinstance(owner, (Linear, GroupedLinear)) and owner.spec.quant != "none" and name.endswith(".weight")):
            tensors[name] = dequant[name] = w
            continue
        amax = w.float().abs().amax(dim=-1) if per_channel else w.float().abs().amax()
        s = (amax / quant.FP8_MAX).clamp_min(1e-12)  # [O] per channel, [] per tensor
        q = (w.float() / (s[:, None] if per_channel else s)).clamp(-448, 448).to(FP8)
        stem = name.removesuffix("weight")
        tensors[name], dequant[name] = q, q.float() * (s[:, None] if per_channel else s)
        if stem != drop_scale_of:
            tensors[stem + "weight_scale"] = s
            tensors[stem + "input_scale"] = torch.tensor(0.05)
        else:  # this layer ships unquantized: bf16 weight, no scales
            tensors[name] = dequant[name] = w
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    algo = "FP8_PER_CHANNEL_PER_TOKEN" if per_channel else "FP8"
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": algo}}))
    return tensors, dequant


def load(cfg, path, scheme):
    m = build(cfg, scheme)
    assert m.prepare_prequantized() > 0
    load_checkpoint(path, [LoadTarget("", m, m.param_name_for)], progress=False)
    m.finalize()
    return m.eval()


@pytest.mark.parametrize("per_channel,scheme", [(False, "fp8_tensor"), (False, "fp8_row"), (True, "fp8_row")])
def test_modelopt_fp8_checkpoint_loads_as_is(cfg, tmp_path, per_channel, scheme):
    tensors, dequant = modelopt_checkpoint(cfg, tmp_path, per_channel)
    ckpt_scheme = quant.checkpoint_scheme(tmp_path)
    assert ckpt_scheme == ("fp8_row" if per_channel else "fp8_tensor")
    assert quant.checkpoint_refusal(ckpt_scheme, scheme) is None
    m = load(cfg, tmp_path, scheme)

    qkv = m.model.layers[0].self_attn.qkv_proj
    name = "model.layers.0.self_attn.qkv_proj."
    assert qkv.weight.dtype == FP8 and torch.equal(qkv.weight.view(torch.uint8),
                                                   tensors[name + "weight"].view(torch.uint8))
    assert torch.equal(qkv.weight_scale.reshape(-1).expand(qkv.weight.shape[0]) if qkv.weight_scale.numel() == 1
                       else qkv.weight_scale.reshape(-1),
                       tensors[name + "weight_scale"].reshape(-1).expand(qkv.weight.shape[0]))
    assert float(qkv.input_scale) == pytest.approx(0.05)
    ex = m.model.layers[1].mlp.experts.down_proj
    e_name = "model.layers.1.mlp.experts.2.down_proj."
    assert torch.equal(ex.weight[2].view(torch.uint8), tensors[e_name + "weight"].view(torch.uint8))
    assert torch.allclose(ex.weight_scale[2].reshape(-1), tensors[e_name + "weight_scale"].reshape(-1).expand(
        ex.weight.shape[1]))
    assert torch.allclose(ex.input_scale, torch.full_like(ex.input_scale, 0.05))

    # the same function as online quantization of the dequantized weights (same scale granularity), else
    # the dequantized weights unquantized, up to the activations' dynamic quantization
    exact = per_channel == (scheme == "fp8_row")
    online = build(cfg, scheme if exact else "none")
    from omni.models.hunyuan_image3.checkpoint_names import load_state
    load_state(online, dequant)
    online.finalize()
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for layer_a, layer_b in zip(m.model.layers, online.model.layers):
            for fa, fb in ((layer_a.mlp, layer_b.mlp), (layer_a.self_attn.qkv_proj, layer_b.self_attn.qkv_proj)):
                a, b = fa(x), fb(x)
                assert float((a - b).norm() / b.norm()) < (1e-3 if exact else 6e-2)


def test_a_layer_without_scales_is_quantized_online(cfg, tmp_path):
    stem = "model.layers.0.self_attn.o_proj."
    modelopt_checkpoint(cfg, tmp_path, per_channel=False, drop_scale_of=stem)
    m = load(cfg, tmp_path, "fp8_row")
    o = m.model.layers[0].self_attn.o_proj
    assert (o.weight.dtype == FP8 and torch.isfinite(o.weight_scale).all()
            and o.weight_scale.shape == (o.weight.shape[0], 1))


def test_scale_shape_mismatch_is_named(cfg, tmp_path):
    modelopt_checkpoint(cfg, tmp_path, per_channel=True)
    from omni.weights import CheckpointError

    m = build(cfg, "fp8_tensor")  # per-channel scales cannot go into per-tensor buffers
    m.prepare_prequantized()
    with pytest.raises(CheckpointError, match="weight_scale.*per-row scales need quant.scheme=fp8_row"):
        load_checkpoint(tmp_path, [LoadTarget("", m, m.param_name_for)], progress=False)
    assert "fp8_row" in quant.checkpoint_refusal("fp8_row", "fp8_tensor")


@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
def test_block_scaled_checkpoints_refuse_naming_quant_scheme(tmp_path, algo):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": algo}}))
    scheme = quant.checkpoint_scheme(tmp_path)
    assert scheme == algo.lower()
    assert f"quant.scheme={scheme}" in quant.checkpoint_refusal(scheme, "fp8_row")
    assert "not implemented" in quant.checkpoint_refusal(scheme, scheme)


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp8"])
def test_block_scaled_recipe_refused_on_the_reference(scheme):
    from omni.recipe import load_recipe

    recipe = load_recipe("cpu_tiny").replace_paths({"quant.scheme": scheme})
    reasons = select("cpu").check_recipe(recipe)
    assert any(f"quant.scheme={scheme}" in r for r in reasons), reasons


def test_unknown_checkpoint_quantization_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="'awq' is not supported"):
        quant.checkpoint_scheme(tmp_path)


def _tp_rank_job(ctx, path: str, x: torch.Tensor):
    """This tp rank's sharded fp8 model loaded from the ModelOpt checkpoint: its scales and layer outputs."""
    from omni.models.hunyuan_image3.build import build_transformer, prequantized
    from omni.parallel.runtime import ParallelRuntime
    from omni.recipe import load_recipe

    cfg_ = _tiny_cfg()
    recipe = load_recipe("cpu_tiny").replace_paths({"quant.scheme": "fp8_row"})
    model, target = build_transformer(cfg_, ctx.platform, BuildOptions(dtype=torch.float32, quant="fp8_row"),
                                      device="cpu", parallel=ParallelRuntime(ctx.mesh, ctx.platform))
    prequantized(Path(path), recipe, model)
    load_checkpoint(path, [target], progress=False, skip_prefixes=("vae.",))
    model.finalize()
    layer, shards = model.model.layers[0], target.read.__self__.shards
    with torch.no_grad():
        return {"qkv": layer.self_attn.qkv_proj(x), "qkv_shard": shards["model.layers.0.self_attn.qkv_proj.weight"],
                "gate_up": layer.mlp.shared_mlp.gate_and_up_proj(x),
                "gate_up_shard": shards["model.layers.0.mlp.shared_mlp.gate_and_up_proj.weight"],
                "o_scale": layer.self_attn.o_proj.weight_scale.clone()}


def _tiny_cfg():
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.tiny import ensure_tiny_checkpoint

    return HunyuanImage3Config.from_file(ensure_tiny_checkpoint() / "config.json")


def test_tensor_parallel_ranks_take_their_rows_of_per_row_scales(cfg, tmp_path):
    """tp2 over a per-channel ModelOpt checkpoint: column-parallel ranks cut the scales with the rows (in the
    KV-group-preserving qkv layout too), row-parallel ranks keep them whole; outputs equal one process's rows."""
    from omni.parallel.launch import launch
    from omni.parallel.mesh import Degrees

    modelopt_checkpoint(cfg, tmp_path, per_channel=True)
    whole = load(cfg, tmp_path, "fp8_row")
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    ranks = launch(_tp_rank_job, Degrees(tp=2), args=(str(tmp_path), x), timeout_s=120)
    layer = whole.model.layers[0]
    with torch.no_grad():
        full = {"qkv": layer.self_attn.qkv_proj(x), "gate_up": layer.mlp.shared_mlp.gate_and_up_proj(x)}
    for r in ranks:
        for name in ("qkv", "gate_up"):
            rows = r[f"{name}_shard"].take(full[name].t().contiguous()).t()
            torch.testing.assert_close(r[name], rows, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["o_scale"], layer.self_attn.o_proj.weight_scale)


def test_prequantized_checkpoint_with_experts_only_is_refused_naming_the_option(cfg, tmp_path):
    """Its dense e4m3 weights would otherwise load into bf16 layers without their scales."""
    from omni.models.hunyuan_image3.build import prequantized
    from omni.recipe import load_recipe

    modelopt_checkpoint(cfg, tmp_path, per_channel=True)
    recipe = load_recipe("cpu_tiny").replace_paths({"quant.scheme": "fp8_row", "quant.experts_only": True})
    with pytest.raises(ValueError, match="quant.experts_only=true cannot keep them in model.dtype"):
        prequantized(tmp_path, recipe, build(cfg, "fp8_row"))
