"""The MoE sort's launches that the cuda platform compiles at build time (``platforms/cuda/route_launch``): one
token count per launch, and together they meet every launch a prompt of any length makes (no GPU needed)."""
from __future__ import annotations

import pytest

from omni.platforms.cuda.pdl import OFF, Pdl
from omni.platforms.cuda.route_launch import MAX_BLOCKS, SORT_BLOCK, route_launch, route_variants


@pytest.mark.parametrize("k", [1, 8, 9], ids=["expert-parallel", "top8", "top8+shared"])
@pytest.mark.parametrize("pdl", [OFF, Pdl(512), Pdl(40)], ids=["no-pdl", "pdl-512", "pdl-40"])
def test_the_build_time_sorts_meet_every_launch_of_any_token_count(k, pdl):
    tokens = route_variants(k, pdl)
    compiled = [route_launch(t * k, pdl) for t in tokens]
    met = {route_launch(t * k, pdl) for t in range(1, MAX_BLOCKS * SORT_BLOCK // k + 2)} - {None}
    assert set(compiled) == met
    assert len(set(compiled)) == len(compiled) and None not in compiled  # one sort per launch, none wasted
    assert tokens == sorted(tokens)


def test_a_launch_changes_with_the_plan_the_chunk_and_the_pdl_keywords():
    pdl = Pdl(512)
    assert route_launch(8, pdl)[0] == "one launch" and route_launch(40, pdl)[0] == "chunks"
    assert route_launch(256, pdl)[1] != route_launch(264, pdl)[1]  # the small chunk up to SMALL_ROWS
    assert route_launch(48, pdl)[2] != route_launch(64, pdl)[2]  # PDL's trigger from TRIGGER_ROWS
    assert route_launch(512, pdl)[2] != route_launch(520, pdl)[2]  # no PDL past the recipe's rows
    assert route_launch(600, pdl) == route_launch(8000, pdl)  # one binary for every prompt in between
    assert route_launch(MAX_BLOCKS * SORT_BLOCK + 1, pdl) is None  # the torch sort
