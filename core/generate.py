"""``omni-run generate`` and ``omni-run edit``: one image through the deployment's engine handle, as ``serve`` runs it.

An edit is the same job whose request carries reference ``images`` (the CLI
decodes and checks them with the server's rules before the engine starts).
With a ``bot_task`` other than ``image`` the model first writes a CoT (think
and/or recaption); it is printed to stderr (the revised prompt), and the
step bar is left out (the engine's steps are CoT tokens first, then
denoising steps).

World size 1 runs the engine loop in this process; a recipe whose parallel
degrees multiply to more launches its ranks exactly as ``serve`` does (one
replica: a single image needs no dp) and the image comes back from the
replica's first rank. There is no single-process fallback.

Where the recipe sets ``serving.compile_first`` the engine first runs the job's
request, cut to the warm-up's steps, inside the platform's compile pass
(``compile_ahead_request``), as a server's warm-up does: the kernels it meets
compile together before the image is drawn, not one by one as the steps
reach them.
"""
from __future__ import annotations

import logging
import sys
import time
from tqdm.auto import tqdm

from .deployment import Deployment, one_replica
from .engine_handle import compile_ahead_request
from .request import GenerateJob, ImageRequest

log = logging.getLogger("omni.generate")


def generate_main(deployment: Deployment, job: GenerateJob) -> int:
    deployment = one_replica(deployment)
    t0 = time.perf_counter()
    engine = deployment.open_engine(progress=True, compile_ahead=(compile_ahead_request(deployment, job.request),))
    try:
        result = _run_one(engine, job.request, steps_here=deployment.world_size == 1)
    finally:
        engine.stop()
    height, width = _write(job, result)
    if result.revised_prompt is not None:
        print(f"revised prompt ({job.request.bot_task}): {result.revised_prompt}", file=sys.stderr)
    if job.verbose:
        fit = "untouched" if (height, width) == (result.height, result.width) else \
            f"fitted to {width}x{height} (centre crop to the aspect, Lanczos)"
        print(f"native size {result.width}x{result.height} (the model's nearest to the request), {fit}")
    edited = f"edit of {len(job.request.images)} image(s), " if job.request.images else ""
    print(f"wrote {job.output} ({edited}{width}x{height}, {result.steps} steps, seed {result.seed}, "
          f"platform {deployment.recipe.platform}, world {deployment.world_size}, "
          f"{time.perf_counter() - t0:.1f}s total; stages {result.times.as_dict()})")
    return 0


def _run_one(engine, req: ImageRequest, steps_here: bool):
    """Submit ``req`` and wait; a step bar when the steps run in this process (the ranks' run elsewhere), made
    once the pipeline is built, so that the loading bar stands alone and the step rate is the steps' own."""
    if not steps_here:
        log.info("the replica's ranks are running the request")
    if req.bot_task != "image":
        log.info("bot_task %s: writing the CoT first (up to %d tokens), then %d denoising steps", req.bot_task,
                 req.cot_max_tokens, req.steps)
    engine.start()
    if not engine.wait_ready():  # the build's own error (a refusal stays a configuration error: exit 2)
        raise engine.error or RuntimeError(engine.unavailable_reason())
    with tqdm(total=req.steps, desc="denoising", unit="step", disable=not steps_here or req.bot_task != "image") as bar:
        engine.observe_steps(lambda finished, dt: bar.update(1) if bar.n < bar.total else None)
        [ticket] = engine.submit_many([req])
        return ticket.result()


def _write(job: GenerateJob, result) -> tuple[int, int]:
    """Write the image at ``job.output_size`` (the size contract, as the server fits it); returns its (h, w)."""
    from PIL import Image

    from .serving.resize import fit_image

    image = result.image_HW3 if job.output_size is None else fit_image(result.image_HW3, *job.output_size)
    job.output.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(job.output)
    if job.latents is not None:
        from safetensors.torch import save_file

        job.latents.parent.mkdir(parents=True, exist_ok=True)
        save_file({"latents": result.latents.contiguous()}, str(job.latents))
    return image.shape[0], image.shape[1]
