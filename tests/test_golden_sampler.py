"""Golden tests: HunyuanImage-3.0 flow-match schedule and timestep embedding against the official code.

Reference tensors: ../shared/golden (official FlowMatchDiscreteScheduler with
shift 3, and the official TimestepEmbedder with the tiny config's weights).
"""
from __future__ import annotations


import pytest
import torch

from omni.platform_manager import select
from omni.models.hunyuan_image3.image_io import TimestepEmbedder, timestep_sinusoid
from omni.models.hunyuan_image3.sampler import cfg_combine, euler_step, flow_match_sigmas, flow_match_timesteps

from golden_utils import GOLDEN_DIR
GOLDEN_TENSORS = GOLDEN_DIR / "hunyuan_image3_tiny.safetensors"
ATOL = 1e-5


@pytest.fixture(scope="module")
def tensors():
    if not GOLDEN_TENSORS.is_file():
        pytest.skip(f"golden data not found in {GOLDEN_DIR} (expected ../shared/golden beside the repo)")
    return pytest.importorskip("safetensors.torch").load_file(str(GOLDEN_TENSORS))


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    err = (got - want).abs().max().item()
    print(f"{name}: max abs err {err:.3g}")
    assert err <= atol, f"{name}: max abs err {err} > {atol}"


def test_default_50_step_sigmas(tensors):
    check("SCHED.default50_sigmas", flow_match_sigmas(50, shift=3.0), tensors["golden.SCHED.default50_sigmas"])


def test_4_step_sigmas_and_timesteps(tensors):
    sigmas = flow_match_sigmas(4)
    check("A.sched4_sigmas", sigmas, tensors["golden.A.sched4_sigmas"])
    check("A.sched4_timesteps", flow_match_timesteps(sigmas), tensors["golden.A.sched4_timesteps"])
    assert torch.allclose(flow_match_timesteps(flow_match_sigmas(8)),
                          torch.tensor([1000, 954.55, 900, 833.33, 750, 642.86, 500, 300]), atol=0.01)


def test_euler_and_cfg_are_fp32():
    x = torch.ones(1, 2, 2, 2, dtype=torch.bfloat16)
    v = cfg_combine(torch.full_like(x, 3.0), torch.ones_like(x), 5.0)
    assert v.dtype == torch.float32 and torch.all(v == 11.0)
    assert torch.all(euler_step(x, v, torch.tensor(1.0), torch.tensor(0.75)) == 1.0 - 11.0 * 0.25)


def test_timestep_sinusoid(tensors):
    # sin/cos of t * freq: the fp32 argument itself is only known to eps * |t| (6e-5 at t = 1000), and vectorized
    # sin/cos (AVX-512 builds) round differently there; 2.9e-5 measured on one such machine
    t = tensors["golden.TEMB.t"]
    bound = max(ATOL, torch.finfo(torch.float32).eps * t.abs().max().item())
    check("TEMB.sinusoid256", timestep_sinusoid(t), tensors["golden.TEMB.sinusoid256"], bound)


def test_timestep_embedder(tensors):
    emb = TimestepEmbedder(64, platform=select("cpu"), dtype=torch.float32)
    emb.load_state_dict({k.removeprefix("timestep_emb."): v for k, v in tensors.items()
                         if k.startswith("timestep_emb.")}, strict=True)
    with torch.no_grad():
        out = emb(tensors["golden.TEMB.t"])
    check("TEMB.timestep_emb_out", out, tensors["golden.TEMB.timestep_emb_out"])
