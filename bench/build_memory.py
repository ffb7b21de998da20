"""What a built pipeline holds on the device, part by part: where a recipe's memory goes after ``build_pipeline``.

Builds ``--recipe`` as ``omni-run bench --full-size-layers`` does (random weights, released widths, layer by
layer) and reports, in GiB:

    transformer      parameters and buffers of the backbone (weights, scales, rope tables)
    vae, vision      the image decoder/encoder and the vision encoder (Instruct checkpoints)
    kv_pool          the paged KV cache (``kv_cache.budget_bytes``)
    other            allocated but none of the above (workspaces, graph pools, caches)
    allocated        ``torch.cuda.memory_allocated()`` after the build
    reserved         ``torch.cuda.memory_reserved()``: what the caching allocator holds, free blocks included
    peak_allocated   the most allocated at any moment of the build
    reserved_after_empty_cache   reserved once the allocator has returned its free blocks

Reserved minus allocated is memory the allocator keeps for reuse; a build whose temporaries are larger leaves
more of it. Run one process per variant so each starts from an empty allocator:

    python bench/build_memory.py --recipe h200_instruct_fp8 --set kernels.fuse_shared_expert=false --json a.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, git_commit  # noqa: E402

from omni.deployment import prepare  # noqa: E402
from omni.recipe import parse_overrides  # noqa: E402

GIB = 2**30


def module_bytes(module) -> int:
    """Bytes of a module's parameters and buffers on the device (0 for None)."""
    if module is None:
        return 0
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")


def parts(engine) -> dict:
    """GiB of each part of the built engine, and what is allocated beyond them."""
    t2i, pool = engine.model, engine.pool
    held = {"transformer": module_bytes(t2i.transformer), "vae": module_bytes(t2i.vae),
            "vision": module_bytes(getattr(t2i, "vision", None)),
            "kv_pool": pool.k.numel() * pool.k.element_size() + pool.v.numel() * pool.v.element_size()}
    allocated = torch.cuda.memory_allocated()
    held["other"] = allocated - sum(held.values())
    out = {k: round(v / GIB, 3) for k, v in held.items()}
    out.update(allocated=round(allocated / GIB, 3), reserved=round(torch.cuda.memory_reserved() / GIB, 3),
               peak_allocated=round(torch.cuda.max_memory_allocated() / GIB, 3))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="h200_fp8", help="recipe name or YAML path")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (released: 32)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override (repeatable)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("build_memory: needs a CUDA device (it reads the CUDA caching allocator)")
    deployment = prepare(a.recipe, overrides=parse_overrides(a.set), random_weights=True)
    engine = deployment.build_pipeline(random_layers=a.layers, progress=False)
    torch.cuda.synchronize()
    out = {"recipe": a.recipe, "overrides": a.set, "layers": a.layers, "commit": git_commit(),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, **parts(engine)}
    torch.cuda.empty_cache()
    out["reserved_after_empty_cache"] = round(torch.cuda.memory_reserved() / GIB, 3)
    return emit(out, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
