"""Instruct-Distil on CUDA: golden case DISTIL through the cuda platform's kernels.

The CPU suite holds the Distil pipeline (one row, ``<timestep> <guidance>
<timestep_r>`` tokens, the 8-step shift-3 schedule, meanflow) to the official
tensors at 1e-5 (tests/test_golden_distil.py). Here the same checkpoint is
built on the ``cuda`` platform and stepped twice through the engine's
prefix-KV path: in fp32 (TF32 off) both steps' velocity and latents must stay
within different-reduction-order error of the official CPU tensors; in bf16
(FA3 / varlen attention, the Triton MoE) within bf16 error; and bf16 steps
replayed from CUDA graphs must equal the eager ones.
"""
from __future__ import annotations

import pytest
import torch

from golden_utils import distil_request, instruct_on_cuda, rel_err, write_instruct_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

# (step pred, latents) pairs the official run stored: step 1 over the whole sequence, step 2 through its KV cache
STORED = (("DISTIL.pred", "DISTIL.latents_next"), ("DISTIL_step2.pred", "DISTIL_step2.latents_next"))


@pytest.fixture(scope="module")
def distil(instruct_golden, tmp_path_factory):
    """(json description, golden tensors without their prefix, the Distil checkpoint directory)."""
    meta, t = instruct_golden
    cfg = {**meta["tiny_config"], "cfg_distilled": True, "use_meanflow": True}
    root = write_instruct_checkpoint({**meta, "tiny_config": cfg}, t, tmp_path_factory.mktemp("distil_ckpt"),
                                     keep_distil=True)
    g = {k.removeprefix("golden."): v for k, v in t.items() if k.startswith("golden.")}
    return meta, g, root


@torch.inference_mode()
def two_steps(engine, meta, g, steps: int = 2):
    """[(pred, latents) after each step], on the host in fp32, from the golden initial noise."""
    seen, out = [], []
    engine.on_velocity = lambda state, v: seen.append(v.float().cpu())
    s = engine.admit(distil_request(meta))
    try:
        # the noise is drawn in bf16 on a CPU generator whose normals differ between torch builds (see
        # test_gpu_edit): start from the official draw so that the steps themselves are compared
        s.latents_1Chw = g["DISTIL.latents_xt"].to(s.latents_1Chw.device, s.latents_1Chw.dtype)
        engine.prefill([s])
        for _ in range(steps):
            engine.denoise_step([s])
            out.append((seen[-1], s.latents_1Chw.float().cpu()))
    finally:
        engine.on_velocity = None
        engine.release(s)
    return out


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_distil_two_steps_on_cuda_match_official(distil, no_tf32, dtype, tol):
    meta, g, root = distil
    engine = instruct_on_cuda(root, dtype)
    assert engine.model.cfg.cfg_distilled and engine.model.cfg.use_meanflow
    for i, ((pred, latents), (want_pred, want_latents)) in enumerate(zip(two_steps(engine, meta, g), STORED)):
        err_pred, err_next = rel_err(pred, g[want_pred]), rel_err(latents, g[want_latents])
        print(f"distil {dtype} step {i + 1}: pred rel err {err_pred:.2e}, latents rel err {err_next:.2e}")
        assert err_pred <= tol and err_next <= tol, (dtype, i + 1, err_pred, err_next)
    assert engine.pool.free_pages == engine.pool.num_pages


def test_distil_steps_replayed_from_cuda_graphs_equal_eager(distil):
    meta, g, root = distil
    eager = two_steps(instruct_on_cuda(root, "bfloat16"), meta, g, steps=3)
    captured_engine = instruct_on_cuda(root, "bfloat16", **{"graph.mode": "capture"})
    captured = two_steps(captured_engine, meta, g, steps=3)
    for (_, want), (_, got) in zip(eager, captured):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert captured_engine.step_graphs.replays >= 1, "the steps were not replayed from a graph"
