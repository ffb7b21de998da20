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


def request_from_args(args, recipe) -> ImageRequest:
    """The CLI has already filled width/height/steps/guidance from the recipe defaults."""
    d = recipe.defaults
    return ImageRequest(prompt=args.prompt, negative_prompt=getattr(args, "negative_prompt", None),
                        height=args.height, width=args.width, steps=args.steps, guidance=args.guidance,
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
