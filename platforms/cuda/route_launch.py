"""How ``route_triton.route_rows`` launches the counting sort of ``R`` expert assignments, and one token count per
launch a deployment can meet: ``TritonKernels.compile_routes`` sorts each once at build time, so that Triton
compiles every binary there and not in the first request of a new prompt length (a compile took about 0.5 s on
the H200, BENCHMARKS.md "Twenty-ninth session"). No triton import: the CPU tests check the launches' cover.
"""
from __future__ import annotations

from .pdl import TRIGGER_ROWS, Pdl

# The counting sort's shape: SORT_BLOCK assignments per program, ranked SORT_CHUNK at a time; its programs read
# every block's counts, so it takes up to MAX_BLOCKS blocks and MAX_EXPERTS experts (a longer prefill sorts
# with torch).
SORT_BLOCK, SORT_CHUNK, MAX_BLOCKS, MAX_EXPERTS = 1024, 128, 256, 256
# A decode step routes a few rows (top-8 of 1-32 tokens): ranked SMALL_CHUNK at a time, the one program ranks
# [32, 32] tiles instead of [128, 128] ones. The 1024-row chunks of 128 took 101 us a layer for 8 rows on the
# H200 (bench/profile_decode.py, BENCHMARKS.md fourteenth session).
SMALL_ROWS, SMALL_CHUNK = 256, 32
# Up to this many assignments (a decode step of up to 4 answers) one program sorts them all in one launch
# (``_route_one_block_kernel``). bench/bench_route_rows.py on the H200, graphs of 32 sorts (BENCHMARKS.md "Sixteenth
# session"): 8-32 assignments 1.9 us against 3.4-3.6 for the per-chunk count and place kernels and 9.6 for the
# per-1024-rows ones; from 48 assignments the per-chunk kernels are faster (4.31 vs 4.62 us, 256: 5.94 vs 8.14).
ONE_BLOCK_ROWS = 32
# Past it and up to CHUNK_ROWS assignments (a decode step of 5-1024 answers, a prompt of up to 1024 tokens) the
# count and place kernels run one program per CHUNK_BLOCK rows, so the places of all chunks are made at once: with
# one program per 1024 rows a step of 64 answers (512 assignments) spent 36 us a layer in the place kernel, one
# chunk after another (bench/profile_decode.py); per chunk the sort of 512 assignments takes 5.3 us against 23.3,
# of 4096 6.0 against 28.8 (bench/bench_route_rows.py, BENCHMARKS.md "Sixteenth session").
CHUNK_BLOCK, CHUNK_ROWS = 128, 8192
# The place kernel reads the blocks' counts this many blocks at a time, by plan: a decode step's (up to 128
# answers) and an image step's (65 blocks) in one read, as the power-of-two tile of the count did, which compiled
# a binary per power (bench/bench_route_rows.py --against, BENCHMARKS.md "Twenty-ninth session").
PLACE_BLOCKS = {"chunks": 8, "blocks": 128}


def route_plan(R: int) -> str:
    """How ``route_rows`` launches the sort of ``R`` assignments: ``one launch`` (one program sorts them all),
    ``chunks`` (count and place kernels, one program per ``CHUNK_BLOCK`` rows: the places in parallel) or
    ``blocks`` (one program per ``SORT_BLOCK`` rows, ranked a chunk at a time: an image step's 65,552)."""
    if R <= ONE_BLOCK_ROWS:
        return "one launch"
    return "chunks" if R <= CHUNK_ROWS else "blocks"


ROUTE_PLANS = ("one launch", "chunks", "blocks")


def route_chunk(R: int) -> int:
    """How many assignments the sort of ``R`` ranks at a time (its warps follow: 4 for the small chunk, else 8)."""
    return SMALL_CHUNK if R <= SMALL_ROWS else SORT_CHUNK


def route_launch(R: int, pdl: Pdl) -> tuple | None:
    """What picks the sort's binaries for ``R`` assignments: its plan, its chunk (the warps follow the chunk) and
    its PDL keywords; None past ``MAX_BLOCKS`` blocks, where ``route_rows`` hands over to the torch sort. The
    other launch arguments are the same binary for every ``R`` (``do_not_specialize``, a fixed place tile)."""
    plan = route_plan(R)
    if -(-R // (CHUNK_BLOCK if plan == "chunks" else SORT_BLOCK)) > MAX_BLOCKS:
        return None
    return plan, route_chunk(R), tuple(sorted(pdl.kw(R).items()))


def route_variants(k: int, pdl: Pdl) -> list[int]:
    """One token count ``T`` for each launch (``route_launch``) the sort of ``T x k`` assignments can make, the
    smallest first. The launches change only at these edges, so the counts on either side of each meet them all."""
    limit = MAX_BLOCKS * SORT_BLOCK
    edges = (1, ONE_BLOCK_ROWS, SMALL_ROWS, CHUNK_ROWS, TRIGGER_ROWS - 1, pdl.max_rows, limit)
    seen, tokens = set(), []
    for t in sorted({t for e in edges for t in (e // k, e // k + 1) if 0 < t * k <= limit}):
        key = route_launch(t * k, pdl)
        if key is not None and key not in seen:
            seen.add(key)
            tokens.append(t)
    return tokens
