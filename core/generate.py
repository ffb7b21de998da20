"""``omni-run generate``: one image from the command line, default recipe = the embedded tiny model."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from tqdm.auto import tqdm

from .engine import Engine
from .platform_manager import select
from .request import ImageRequest

log = logging.getLogger("omni.generate")


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` (OpenAI convention) -> (height, width)."""
    try:
        w, h = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise ValueError(f"--size must look like 1024x1024 (width x height), got {size!r}") from None
    return h, w


def request_from_args(args, recipe) -> ImageRequest:
    d = recipe.defaults
    h, w = parse_size(args.size or d.size)
    return ImageRequest(prompt=args.prompt, negative_prompt=getattr(args, "negative_prompt", None),
                        height=h, width=w, steps=args.steps or d.steps,
                        guidance=d.guidance if args.guidance is None else args.guidance,
                        seed=args.seed, shift=d.shift, template=d.template, system_prompt=d.system_prompt)


def generate_main(args, recipe) -> int:
    from omni.models.hunyuan_image3.build import build_pipeline
    from PIL import Image

    platform = select(args.platform or recipe.platform, trace=getattr(args, "trace", False))
    t0 = time.perf_counter()
    pipeline = build_pipeline(recipe, platform, model_path=getattr(args, "model", None))
    req = request_from_args(args, recipe)
    bar = tqdm(total=req.steps, desc="denoising", unit="step")
    result = Engine(pipeline).run([req], progress=lambda res, eng: bar.update(1))[0]
    bar.close()
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(result.image_HW3).save(out)
    print(f"wrote {out} ({result.width}x{result.height}, {result.steps} steps, seed {result.seed}, "
          f"platform {platform.name}, {time.perf_counter() - t0:.1f}s total; stages {result.times.as_dict()})")
    return 0
