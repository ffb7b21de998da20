"""Captured denoising steps shared across prompt lengths, on the H200 (issue 17: capture that pays).

With attention that reads sequence lengths on the device (FA3, varlen), the
key tables are padded to a bucket, so requests with prompts of other
lengths replay ONE captured step (their tables copied in) instead of each
capturing its own graph (a new pool per request grew reserved memory by
~2 GiB per request at the released shapes). Each replayed request must equal
its eager run, and the stage times must put the step time in ``denoise``.
"""
from __future__ import annotations

import pytest
import torch

from golden_utils import instruct_engine
from omni.request import ImageRequest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

PROMPTS = ("a cat", "a red cat sitting on a green sofa in the afternoon sun, watercolour",
           "two dogs " * 12)


def engine(root, kv: str, **changes):
    return instruct_engine(root, "cuda", **{"platform": "cuda", "device.kind": "h200", "model.dtype": "bfloat16",
                                            "kv_cache.mode": kv, **changes})


@torch.inference_mode()
def run(e, prompt: str, steps: int = 3):
    s = e.admit(ImageRequest(prompt=prompt, height=256, width=256, steps=steps, guidance=5.0, seed=3,
                             template="instruct"))
    e.prefill([s])
    while s.step < steps:
        e.denoise_step([s])
    out, times = s.latents_1Chw.float().cpu(), s.times
    e.release(s)
    return out, times


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_prompt_lengths_replay_one_captured_step(instruct_checkpoint, kv):
    pages = {"kv_cache.page_tokens": 256}  # the paged varlen kernel needs 256-token pages
    eager = engine(instruct_checkpoint, kv, **pages)
    captured = engine(instruct_checkpoint, kv, **pages, **{"graph.mode": "capture"})
    attn = captured.model.transformer.model.layers[0].self_attn.attn["none"]
    bucketed = getattr(attn, "reads_host_lengths", True) is False  # else each prompt length is its own graph
    assert bucketed == (captured.step_graphs.key_bucket > 0)
    for p in PROMPTS:
        want, _ = run(eager, p)
        got, times = run(captured, p)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert times.denoise > 0 and times.prefill > 0
    g = captured.step_graphs
    print(f"[capture buckets {kv}] {attn.name}: captures {g.captures}, rebinds {g.rebinds}, replays {g.replays}")
    assert g.replays == 3 * len(PROMPTS)
    if bucketed:
        assert g.captures == 1 and g.rebinds == len(PROMPTS) - 1
    else:  # e.g. paged KV where only SDPA serves it (the fa3-fwd build has no paged KV): host lengths are read
        assert g.captures == len(PROMPTS)
