"""The tile scheduler of bench/csrc/contiguous_fp8_probe.cu, in Python: each CTA's walk over the (M, N) tiles.

ContiguousTileScheduler on CUTLASS's PersistentTileSchedulerSm90 enumerates the GEMM's tiles and settles each
CTA on the next tile whose cluster's first M tile has an expert; ``model_walks`` replays that enumeration from
the launch grid the object reports (``ContiguousFp8.grid``), and ``check_model`` asserts what the kernel needs
of it: every valid tile walked once, nothing else, cluster peers in step. bench_cutlass_contiguous.py checks the
model on the CPU and the check kernel's visits against it on the GPU (``walk_hash`` is the kernel's hash).
"""
from __future__ import annotations


def _tile_of(idx: int, g: dict, cta_m: int, cta_n: int) -> tuple[int, int]:
    """(M, N) tile of linear index ``idx`` (StaticPersistentTileScheduler::get_current_work_for_linear_idx and
    PersistentTileSchedulerSm90::get_work_idx_m_and_n, L = 1)."""
    cm, cn, log_sw = g["cm"], g["cn"], g["log_swizzle"]
    if g["along_n"]:
        major, minor, blk_major, minor_off = cn, cm, g["blocks_n"] // cn, cta_m
    else:
        major, minor, blk_major, minor_off = cm, cn, g["blocks_m"] // cm, cta_n
    blk = idx // minor
    cluster_id, major_off = divmod(blk, major)
    offset, extra = cluster_id & ((1 << log_sw) - 1), cluster_id >> log_sw
    minor_div_sw, cluster_major = divmod(extra, blk_major)
    cluster_minor = minor_div_sw * (1 << log_sw) + offset
    minor_idx, major_idx = cluster_minor * minor + minor_off, cluster_major * major + major_off
    return (minor_idx, major_idx) if g["along_n"] else (major_idx, minor_idx)


def model_walks(g: dict, tile_expert: list[int], expert_tiles: list[int], monotone_exit: bool | None = None) -> dict:
    """Each CTA's walk, {(bx, by): [(M, N, expert), ...]}: from its first index, steps of the grid size, each to the
    next tile whose cluster's first M tile has an expert (ContiguousTileScheduler::settle). ``monotone_exit``: end
    at the first -1 (None: as the C++ does, along N without swizzle). The expert-major order (``g["expert_major"]``:
    settle_expert_major) walks clusters, each expert's block M fastest."""
    if g["expert_major"]:
        return _model_walks_expert_major(g, tile_expert, expert_tiles)
    if monotone_exit is None:
        monotone_exit = bool(g["along_n"]) and g["log_swizzle"] == 0
    gx, gy, gz = g["gx"], g["gy"], g["gz"]
    stride, end, tiles_m = gx * gy * gz, g["blocks"], len(tile_expert)
    walks = {}
    for bx in range(gx):
        for by in range(gy):
            idx = bx + by * gx if g["along_n"] else bx * gy + by
            cta_m, cta_n = bx % g["cm"], by % g["cn"]
            walk = []
            while idx < end:
                m, n = _tile_of(idx, g, cta_m, cta_n)
                lead = m - m % g["cm"]
                e = tile_expert[lead] if lead < tiles_m else -1
                if e >= 0:
                    walk.append((m, n, e))
                elif monotone_exit:
                    break
                idx += stride
            walks[bx, by] = walk
    return walks


def _model_walks_expert_major(g: dict, tile_expert: list[int], expert_tiles: list[int]) -> dict:
    cm, cn, cols, gx, gy = g["cm"], g["cn"], g["cluster_cols"], g["gx"], g["gy"]
    end = -(-len(tile_expert) // cm) * cols
    stride = (gx // cm) * (gy // cn) * g["gz"]
    walks = {}
    for bx in range(gx):
        for by in range(gy):
            idx, walk = bx // cm + (by // cn) * (gx // cm), []
            while idx < end:
                e = tile_expert[(idx // cols) * cm]
                if e < 0:
                    break
                first = expert_tiles[e]
                rows, local = (expert_tiles[e + 1] - first) // cm, idx - first // cm * cols
                walk.append((first + local % rows * cm + bx % cm, local // rows * cn + by % cn, e))
                idx += stride
            walks[bx, by] = walk
    return walks


def walk_hash(walk, cm: int) -> int:
    """The check kernel's hash of a walk (walk_hash in the .cu), as a signed int32."""
    h = 0
    for m, _, e in walk:
        h = ((h * 16777619) ^ ((m - m % cm) * 131 + e + 1)) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def check_model(g: dict, tile_expert: list[int], expert_tiles: list[int], n_tiles: int) -> dict:
    """Assert on the model: every valid tile walked once, nothing else; cluster peers in step; the first -1 ending a
    walk changes nothing when it is used. Returns the per-CTA walks."""
    walks = model_walks(g, tile_expert, expert_tiles)
    if bool(g["along_n"]) and g["log_swizzle"] == 0 and not g["expert_major"]:
        assert walks == model_walks(g, tile_expert, expert_tiles, monotone_exit=False), "the early end drops tiles"
    seen = {}
    for walk in walks.values():
        for m, n, e in walk:
            seen[m, n] = seen.get((m, n), 0) + 1
            assert e == tile_expert[m], f"tile {m} walked with expert {e}, its expert is {tile_expert[m]}"
    want = {(m, n) for m, e in enumerate(tile_expert) if e >= 0 for n in range(n_tiles)}
    extra = {t for t in seen if t not in want and t[1] < n_tiles}  # N tiles past N (cluster rounding) are clipped
    assert not extra, f"{len(extra)} tiles walked that have no expert, e.g. {sorted(extra)[:3]}"
    missing = want - set(seen)
    assert not missing, f"{len(missing)} valid tiles never walked, e.g. {sorted(missing)[:3]}"
    twice = [t for t, c in seen.items() if c > 1]
    assert not twice, f"{len(twice)} tiles walked twice, e.g. {twice[:3]}"
    for (bx, by), walk in walks.items():
        peer = walks[bx - bx % g["cm"], by - by % g["cn"]]
        assert [(m - m % g["cm"], e) for m, _, e in walk] == [(m - m % g["cm"], e) for m, _, e in peer], \
            f"CTA {(bx, by)} out of step with its cluster"
    return walks
