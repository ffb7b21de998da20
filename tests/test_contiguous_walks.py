"""bench/contiguous_walks.py, the Python model of the contiguous probe's tile scheduler, on small grids.

On the H200 the probe's check kernel walked the scheduler and matched this model CTA by CTA (BENCHMARKS.md,
thirteenth session); here the model's own checks run on hand-made grids: they pass where the walk covers the
valid tiles once, and they fail where a tile has no expert yet is walked.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from contiguous_walks import check_model, model_walks, walk_hash  # noqa: E402


def grid(tiles_m: int, tiles_n: int, *, along_n: bool, ctas: int) -> dict:
    """A launch grid of ``ctas`` CTAs (no clusters, no swizzle) over tiles_m x tiles_n tiles."""
    gx, gy = (ctas, 1) if not along_n else (1, ctas)
    return {"cm": 1, "cn": 1, "log_swizzle": 0, "along_n": along_n, "blocks_m": tiles_m, "blocks_n": tiles_n,
            "blocks": tiles_m * tiles_n, "gx": gx, "gy": gy, "gz": 1, "expert_major": False}


@pytest.mark.parametrize("along_n", [False, True])
def test_every_tile_with_an_expert_is_walked_once(along_n):
    tile_expert = [0, 0, 1, 2, 2, 2, -1, -1]  # 6 valid M tiles of 3 experts, 2 padding tiles at the end
    walks = check_model(grid(8, 3, along_n=along_n, ctas=4), tile_expert, [0, 2, 3, 6], n_tiles=3)
    walked = sorted((m, n) for w in walks.values() for m, n, _ in w)
    assert walked == [(m, n) for m in range(6) for n in range(3)]
    assert all(e == tile_expert[m] for w in walks.values() for m, _, e in w)


def test_a_hole_in_the_middle_is_skipped_not_walked():
    """An expert-less tile between valid ones (a layout bug the kernel must never meet) is left out of the walk;
    the valid tiles after it are still walked."""
    walks = model_walks(grid(4, 2, along_n=False, ctas=3), [0, -1, 1, 1], [0, 1, 2, 4], monotone_exit=False)
    walked = sorted((m, n) for w in walks.values() for m, n, _ in w)
    assert walked == [(0, 0), (0, 1), (2, 0), (2, 1), (3, 0), (3, 1)]


def test_the_check_fails_where_a_valid_tile_is_never_walked():
    """Along N without swizzle the walk ends at the first expert-less tile; a hole before valid tiles drops them,
    and check_model says so."""
    with pytest.raises(AssertionError, match="the early end drops tiles|never walked"):
        check_model(grid(4, 2, along_n=True, ctas=2), [0, -1, 1, 1], [0, 1, 2, 4], n_tiles=2)


def test_walk_hash_is_a_signed_int32_and_order_sensitive():
    a, b = [(0, 0, 0), (1, 0, 1)], [(1, 0, 1), (0, 0, 0)]
    assert -(1 << 31) <= walk_hash(a, 1) < (1 << 31) and walk_hash(a, 1) != walk_hash(b, 1)
    assert walk_hash([], 1) == 0
