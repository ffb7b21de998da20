"""Parallel layouts reproduce the single-process predictions on the golden tiny weights (CPU, gloo).

One spawned job per world size runs every layout of that size on each rank
(meshes are rebuilt per layout over the same processes; see parity.py for
the scenario: three packed requests, prefill + two cached denoising steps
through the paged prefix-KV pool). Every rank's predictions and latents must
equal the single-process ones within 1e-5 (fp32).

The golden tiny model has 4 query heads, 2 KV heads, 4 experts, hidden 64:
tp2 gives each rank one KV group; tp4 is refused (test_mesh_and_plan.py).
Layout names: ``ep2`` is cfg2 x ep2 (two ranks with different tokens, so the
experts are reached by all-to-all dispatch); ``tp2xep2`` is EP inside a tp
group (no all-to-all); ``-gather`` runs the contiguous (non-paged) KV mode.
"""
from __future__ import annotations

import pytest
import torch

import parity
from omni.parallel.launch import launch
from omni.parallel.mesh import Degrees

pytestmark = [pytest.mark.skipif(not parity.golden_available(),
                                 reason=f"golden data not found in {parity.GOLDEN_DIR} (expected ../shared/golden)"),
              pytest.mark.timeout(240)]

ATOL = 1e-5
JOB_TIMEOUT_S = 150
# (test id, mesh layout, paged KV)
WORLD2 = [("tp2", "tp2", True), ("ep2", "cfg2xep2", True), ("ulysses2", "ulysses2", True), ("ring2", "ring2", True),
          ("cfg2", "cfg2", True), ("tp2xep2", "tp2xep2", True), ("ulysses2xep2", "ulysses2xep2", True),
          ("ulysses2-gather", "ulysses2", False), ("ring2-gather", "ring2", False)]
WORLD4 = [("tp2xcfg2", "cfg2xtp2", True), ("ulysses2xtp2", "ulysses2xtp2", True), ("ring2xtp2", "ring2xtp2", True),
          ("cfg2xtp2xep4", "cfg2xtp2xep4", True), ("ulysses4", "ulysses4", True)]


def _job(layouts):
    """Run every (layout, paged) pair on one spawned world; {test id: [per-rank results]}."""
    pairs = list(dict.fromkeys((lay, paged) for _, lay, paged in layouts))
    per_rank = launch(parity.layout_worker, Degrees.parse(pairs[0][0]), args=(pairs,), timeout_s=JOB_TIMEOUT_S)
    return {tid: [r[(lay, paged)] for r in per_rank] for tid, lay, paged in layouts}


@pytest.fixture(scope="module")
def reference():
    """The single-process run (the oracle), itself checked against the official golden predictions."""
    from safetensors import safe_open

    from omni.platform_manager import select

    ref = parity.run_scenario(parity.build(select("cpu")), parity.golden_latents_A())
    with safe_open(str(parity.GOLDEN_TENSORS), framework="pt") as f:
        for step, key in enumerate(("golden.A.pred", "golden.A_step2.pred")):
            err = (ref["A"]["pred"][step] - f.get_tensor(key)).abs().max().item()
            assert err <= ATOL, f"single-process oracle step {step + 1} vs {key}: {err}"
    return ref


@pytest.fixture(scope="module")
def world2():
    return _job(WORLD2)


@pytest.fixture(scope="module")
def world4():
    return _job(WORLD4)


def assert_same(ref: dict, got: dict, where: str) -> None:
    for rid in ("A", "B", "C"):
        for what in ("pred", "latents"):
            want, have = ref[rid][what], got[rid][what]
            assert len(have) == len(want) == 2, f"{where} {rid}: {len(have)} {what} steps recorded"
            for step, (w, h) in enumerate(zip(want, have), 1):
                assert h.shape == w.shape, (
                    f"{where} {rid} step {step} {what}: shape {tuple(h.shape)} vs {tuple(w.shape)}")
                err = (h.float() - w.float()).abs().max().item()
                assert err <= ATOL, f"{where} {rid} step {step} {what}: max abs err {err:.3g} > {ATOL}"
    assert got["_pool_all_free"], f"{where}: KV pages still held after every request was released"


@pytest.mark.parametrize("tid", [t for t, _, _ in WORLD2])
def test_world2_layout_matches_single_process(world2, reference, tid):
    for rank, got in enumerate(world2[tid]):
        assert_same(reference, got, f"{tid} rank {rank}")


@pytest.mark.parametrize("tid", [t for t, _, _ in WORLD4])
def test_world4_layout_matches_single_process(world4, reference, tid):
    for rank, got in enumerate(world4[tid]):
        assert_same(reference, got, f"{tid} rank {rank}")


def test_tp2_with_the_shared_expert_fused_matches_single_process(reference):
    """``kernels.fuse_shared_expert`` under tp2: each rank's expert stack holds its slice of the shared expert
    as the last group (the same column / row split as the experts), so the one all-reduce still sums it."""
    layout = ("tp2", True, True)
    per_rank = launch(parity.layout_worker, Degrees.parse("tp2"), args=([layout],), timeout_s=JOB_TIMEOUT_S)
    for rank, got in enumerate(per_rank):
        assert_same(reference, got[layout], f"tp2 fused, rank {rank}")


def test_scenario_has_uneven_sequence_splits(reference):
    """The packed step holds 17+17 (A) + 13+13 (B) + 13 (C) = 73 tokens: odd, so sp splits are uneven."""
    from omni.parallel.sequence import split_sizes

    steps = sum(p.shape[0] * (1 + p.shape[-1] * p.shape[-2]) for p in (ref[0] for ref in
                (reference[r]["pred"] for r in ("A", "B", "C"))))
    assert steps == 73 and split_sizes(steps, 2) == [37, 36] and split_sizes(steps, 4) == [19, 18, 18, 18]
    assert torch.isfinite(reference["C"]["pred"][1]).all()
