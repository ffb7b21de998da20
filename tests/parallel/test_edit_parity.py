"""Parallel layouts reproduce single-process editing and text decoding on the golden Instruct weights (CPU, gloo).

One spawned world of two ranks runs tp2, ulysses2, ring2 and cfg2 on the scenario of edit_parity.py: an editing
request with two reference images, an Instruct text-to-image row and a
greedy text answer (T2T), packed; the reference images' prefix is prefilled into the KV pool under the
layout, then two steps run against it. Every rank's predictions and latents
must equal the single-process ones within 1e-5 (fp32), and the
single-process first step must equal the official IT2I_1 / IT2I_2 tensors.
"""
from __future__ import annotations

import pytest
import torch

import edit_parity
from omni.parallel.launch import launch
from omni.parallel.mesh import Degrees

pytestmark = [pytest.mark.skipif(not edit_parity.golden_available(),
                                 reason=f"golden data not found in {edit_parity.GOLDEN_DIR}"),
              pytest.mark.timeout(300)]

ATOL = 1e-5
JOB_TIMEOUT_S = 240
# contiguous KV under sequence parallel is covered by test_parity.py; each layout here encodes 3 images
WORLD2 = [("tp2", "tp2", True), ("ulysses2", "ulysses2", True), ("ring2", "ring2", True), ("cfg2", "cfg2", True)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return edit_parity.write_checkpoint(tmp_path_factory.mktemp("edit_parity") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The single-process run (the oracle), itself checked against the official first step."""
    from safetensors import safe_open

    from omni.platform_manager import select

    ref = edit_parity.run_scenario(edit_parity.build(checkpoint, select("cpu")))
    with safe_open(str(edit_parity.GOLDEN_TENSORS), framework="pt") as f:
        for rid, case in (("E2", "IT2I_2"),):
            for got, key in ((ref[rid]["pred"][0], "pred"), (ref[rid]["latents"][1], "latents_next")):
                err = (got - f.get_tensor(f"golden.{case}.{key}")).abs().max().item()
                assert err <= ATOL, f"single-process {rid} vs golden {case}.{key}: {err}"
        for rid, case in (("A1", "T2T"),):
            want = f.get_tensor(f"golden.{case}.generated_ids")[:3].tolist()
            assert ref[rid]["tokens"] == want, f"single-process {rid} tokens vs golden {case}"
    return ref


@pytest.fixture(scope="module")
def world2(checkpoint):
    pairs = list(dict.fromkeys((lay, paged) for _, lay, paged in WORLD2))
    per_rank = launch(edit_parity.layout_worker, Degrees.parse(pairs[0][0]), args=(str(checkpoint), pairs),
                      timeout_s=JOB_TIMEOUT_S)
    return {tid: [r[(lay, paged)] for r in per_rank] for tid, lay, paged in WORLD2}


@pytest.mark.parametrize("tid", [t for t, _, _ in WORLD2])
def test_text_decoding_layout_matches_single_process(world2, reference, tid):
    """A greedy answer beside the edit: same tokens on every rank, every step's logits within 1e-5."""
    for rank, got in enumerate(world2[tid]):
        for rid in ("A1",):
            assert got[rid]["tokens"] == reference[rid]["tokens"], f"{tid} rank {rank} {rid}"
        want, have = reference["_text_logits"], got["_text_logits"]
        assert len(have) == len(want), f"{tid} rank {rank}: {len(have)} text forwards, expected {len(want)}"
        for step, (w, h) in enumerate(zip(want, have)):
            err = (h.float() - w.float()).abs().max().item()
            assert h.shape == w.shape and err <= ATOL, f"{tid} rank {rank} text logits[{step}]: {err:.3g}"


@pytest.mark.parametrize("tid", [t for t, _, _ in WORLD2])
def test_editing_layout_matches_single_process(world2, reference, tid):
    for rank, got in enumerate(world2[tid]):
        for rid in ("E2", "T"):
            for what in ("pred", "latents"):
                want, have = reference[rid][what], got[rid][what]
                assert len(have) == len(want), f"{tid} rank {rank} {rid}: {len(have)} {what} recorded"
                for step, (w, h) in enumerate(zip(want, have)):
                    err = (h.float() - w.float()).abs().max().item()
                    assert h.shape == w.shape and err <= ATOL, f"{tid} rank {rank} {rid} {what}[{step}]: {err:.3g}"
        assert got["_pool_all_free"], f"{tid} rank {rank}: KV pages still held after release"


def test_scenario_packs_odd_token_counts(reference):
    """E2 is a CFG pair, T is one row: the packed step has an odd token count (uneven sp splits)."""
    rows = {rid: reference[rid]["pred"][0] for rid in ("E2", "T")}
    tokens = sum(p.shape[0] * (1 + p.shape[-1] * p.shape[-2]) for p in rows.values())
    assert rows["T"].shape[0] == 1 and tokens % 2 == 1
    assert all(torch.isfinite(reference[r]["pred"][1]).all() for r in rows)
