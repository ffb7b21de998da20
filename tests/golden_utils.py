"""Helpers over the golden data fixture (see conftest.py)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

# ../shared/golden beside the checkout, or OMNI_GOLDEN_DIR (a device machine receives the repository only, so the
# golden files travel inside it and the environment names where)
GOLDEN_DIR = Path(os.environ.get("OMNI_GOLDEN_DIR") or Path(__file__).resolve().parents[2] / "shared" / "golden")


def build_golden_model(golden_data, platform, **opts):
    """The tiny golden transformer with its official weights on ``platform`` (fp32; ``opts``: other BuildOptions)."""
    from omni.build_options import BuildOptions
    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.transformer import HunyuanImage3Transformer
    from omni.models.hunyuan_image3.checkpoint_names import load_state

    m = HunyuanImage3Transformer(HunyuanImage3Config.from_json_dict(golden_data[0]["tiny_config"]),
                                 platform, BuildOptions(dtype=torch.float32, **opts))
    load_state(m, golden_data[2])
    m.finalize()
    return m.eval()


INSTRUCT_NOT_IN_CHECKPOINT = ("golden.", "guidance_emb.", "timestep_r_emb.")  # golden tensors, Distil-only weights


def write_instruct_checkpoint(meta: dict, tensors: dict, root, keep_distil: bool = False):
    """The Instruct golden weights as an HF-format checkpoint directory (config, safetensors, vocabulary).

    ``keep_distil``: keep ``guidance_emb.*`` / ``timestep_r_emb.*`` (the Distil model; its config must set
    cfg_distilled and use_meanflow)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from omni.models.hunyuan_image3.assets.make_tiny_tokenizer import build

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(meta["tiny_config"]))
    skip = ("golden.",) if keep_distil else INSTRUCT_NOT_IN_CHECKPOINT
    save_file({k: v.contiguous() for k, v in tensors.items() if not k.startswith(skip)},
              str(root / "model.safetensors"))
    build(meta["tiny_vocab"]).save(str(root / "tokenizer.json"))
    return root


def fp32_bound(want: torch.Tensor, atol: float = 1e-5) -> float:
    """The golden tolerance of an fp32 CPU result: ``atol`` per unit of the tensor's largest magnitude.

    Reduction order differs between CPUs (torch's AVX-512 / AMX kernels block GEMMs and reductions their
    own way), and a sum's rounding grows with the magnitudes summed: hidden rows of |4-6| differ from the
    golden by 1.2-2.2e-5 on an AMX machine where other machines stayed below 1e-5.
    """
    return atol * max(1.0, want.float().abs().max().item())


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5) -> None:
    """Same shape and max abs error <= ``fp32_bound(want, atol)`` (fp32 golden comparisons)."""
    assert tuple(got.shape) == tuple(want.shape), (name, tuple(got.shape), tuple(want.shape))
    err = (got.float() - want.float()).abs().max().item()
    bound = fp32_bound(want, atol)
    assert err <= bound, f"{name}: max abs err {err:.3g} > {bound:.3g}"


def instruct_engine(root, on: str = "cpu", **changes):
    """The deployment's Instruct pipeline over the checkpoint at ``root`` (None: the embedded trained tiny
    weights) on platform ``on`` (``changes``: recipe paths, e.g. ``platform``)."""
    from omni.models.hunyuan_image3.build import build_pipeline
    from omni.platform_manager import select
    from omni.recipe import load_recipe

    where = {} if root is None else {"model.path": str(root)}  # None: the recipe's embedded trained weights
    recipe = load_recipe("cpu_tiny_instruct").replace_paths({**where, **changes})
    return build_pipeline(recipe, select(on), progress=False)


def run_to_end(engine, state):
    """Prefill ``state`` and step it until it is done (a text answer or a CoT pass); returns it."""
    engine.prefill([state])
    while not state.done:
        engine.denoise_step([state])
    return state


def instruct_on_cuda(root, dtype: str, **changes):
    """``instruct_engine`` on the cuda platform (an H200's recipe fields) with gathered KV, the layout of the
    recipe h200_instruct_fp8."""
    return instruct_engine(root, "cuda", **{"platform": "cuda", "device.kind": "h200", "model.dtype": dtype,
                                            "kv_cache.mode": "contiguous", **changes})


def tiny_config_at(hidden: int, heads: int, kv_heads: int, head_dim: int, experts: int, topk: int, inner: int):
    """The tiny checkpoint's config at other widths (every layer alike, one shared expert): GPU tests' models."""
    import dataclasses

    from omni.models.hunyuan_image3.config import HunyuanImage3Config
    from omni.models.hunyuan_image3.tiny import ensure_tiny_checkpoint

    cfg = HunyuanImage3Config.from_file(ensure_tiny_checkpoint() / "config.json")
    L = cfg.num_hidden_layers
    return dataclasses.replace(cfg, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               attention_head_dim=head_dim, num_experts=experts, moe_topk=(topk,) * L,
                               moe_intermediate_size=(inner,) * L, num_shared_expert=(1,) * L)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


@contextlib.contextmanager
def recorded_text_logits(engine):
    """Every row the model's ``text_logits`` returns while inside (the engine samples from these), in fp32 on
    the host, in call order."""
    rows, inner = [], engine.model.text_logits

    def recorded(h_TD):
        out = inner(h_TD)
        rows.append(out.float().cpu())
        return out

    engine.model.text_logits = recorded
    try:
        yield rows
    finally:
        del engine.model.text_logits


def distil_request(meta):
    """The golden DISTIL case as the engine's request."""
    from omni.request import ImageRequest

    c = meta["cases"]["DISTIL"]
    h, w = (int(v) for v in c["image_size_argument"].split("x"))
    return ImageRequest(prompt=c["prompt"], system_prompt=c["system_prompt"], cot_text=c["cot_text"], height=h,
                        width=w, steps=c["infer_steps"], guidance=c["guidance_scale"], seed=c["seed"],
                        template="instruct")
