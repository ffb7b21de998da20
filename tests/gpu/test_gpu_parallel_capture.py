"""Captured denoising steps under parallel layouts (issue 17, item 4), with real process groups.

On one GPU (what these run on here):
- cfg2: two ranks share the device over gloo (NCCL refuses two ranks on one device); each captures the
  step of its guidance row, the predictions are exchanged between replays, and the images equal the
  eager cfg2 run and the one-process run;
- tp2 over gloo with capture fails at startup with the platform's reason (gloo blocks the host);
- an NCCL all-reduce inside a step graph (a job of one rank) replays as it runs eagerly.
On two GPUs or more (skipped with one): tp2 over NCCL, captured against eager.
"""
from __future__ import annotations

import pytest
import torch

from omni.parallel.launch import WorkerError, launch
from omni.parallel.mesh import Degrees

from parallel_capture_workers import generate, tiny_engine

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

ONE_GPU = dict(devices=1, backend="gloo")


@pytest.fixture(scope="module")
def single():
    from omni.platform_manager import select

    return generate(tiny_engine(select("cuda"), "eager"))


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_cfg2_captured_on_one_gpu_equals_eager_and_one_process(single, capsys):
    runs = {mode: launch("parallel_capture_workers:layout_run", Degrees(cfg=2), platform="cuda", args=(mode,),
                         timeout_s=300, **ONE_GPU) for mode in ("eager", "capture")}
    for rank in (0, 1):
        cap, eag = runs["capture"][rank], runs["eager"][rank]
        assert cap["rows_here"] == 1 and eag["graphs"] is None
        assert cap["graphs"] == (1, 3), "one capture of this rank's row, replayed every step"
        torch.testing.assert_close(cap["latents"], eag["latents"], atol=1e-3, rtol=1e-3)
    assert torch.equal(runs["capture"][0]["latents"], runs["capture"][1]["latents"]), "both ranks step the same image"
    err = _rel(runs["capture"][0]["latents"], single["latents"])
    with capsys.disabled():
        print(f"\n[cfg2 capture, one GPU over gloo] vs eager cfg2 max "
              f"{(runs['capture'][0]['latents'] - runs['eager'][0]['latents']).abs().max().item():.2e}; "
              f"vs one process rel {err:.2e}")
    assert err < 2e-2, "one row per rank vs both rows packed in one forward: bf16 roundings only"


def test_tp2_capture_over_gloo_fails_at_startup_with_the_reason():
    with pytest.raises(WorkerError, match=r"'gloo' collectives cannot be recorded"):
        launch("parallel_capture_workers:layout_run", Degrees(tp=2), platform="cuda", args=("capture",),
               timeout_s=300, **ONE_GPU)


def test_nccl_all_reduce_replays_from_a_step_graph(capsys):
    res = launch("parallel_capture_workers:nccl_step_graph", Degrees(), platform="cuda", timeout_s=300)[0]
    with capsys.disabled():
        print(f"\n[nccl in a step graph] {res}")
    assert res["backend"] == "nccl" and res["graphs"] == (1, 3)
    assert max(res["errs"]) < 1e-4, "the replay runs the same kernels on the same inputs"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tp2 over NCCL needs two GPUs")
def test_tp2_captured_over_nccl_equals_eager(single, capsys):
    runs = {mode: launch("parallel_capture_workers:layout_run", Degrees(tp=2), platform="cuda", args=(mode,),
                         timeout_s=300) for mode in ("eager", "capture")}
    for rank in (0, 1):
        assert runs["capture"][rank]["graphs"] == (1, 3)
        torch.testing.assert_close(runs["capture"][rank]["latents"], runs["eager"][rank]["latents"],
                                   atol=1e-3, rtol=1e-3)
    res = launch("parallel_capture_workers:nccl_step_graph", Degrees(tp=2), platform="cuda", timeout_s=300)
    assert all(r["world"] == 2 and max(r["errs"]) < 1e-4 for r in res)
    err = _rel(runs["capture"][0]["latents"], single["latents"])
    with capsys.disabled():
        print(f"\n[tp2 capture over NCCL] vs one process rel {err:.2e}")
    assert err < 2e-2
