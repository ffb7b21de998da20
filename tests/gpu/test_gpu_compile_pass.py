"""The warm-up's compile pass on CUDA (``serving.compile_first``, ``omni.compile_pass``): after the pass, the real
warm-up compiles no Triton kernel, the pass captured no graph, and what the server then answers equals a server
that warmed up without the pass.

Each server is a fresh process with an empty Triton cache (``TRITON_CACHE_DIR``): the embedded trained tiny
Instruct model on the cuda platform in bf16 with ``graph.mode: capture`` and gathered KV (the layout of
h200_instruct_fp8), warmed up as ``omni-run serve`` does (``warm_up_requests``: the default image of
``serving.warmup_steps`` steps, an edit of one reference of the default size, then a short greedy answer), then
one image and one answer.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.version.hip is not None, reason="cuda: this torch is a ROCm build"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda: no CUDA device here")]

SERVER = r"""
import json, os, sys
from pathlib import Path
cache, compile_first, out = Path(sys.argv[1]), sys.argv[2] == "1", Path(sys.argv[3])
os.environ["TRITON_CACHE_DIR"] = str(cache)  # empty: every compile of this process lands here
import numpy as np
import torch
from omni.deployment import prepare
from omni.engine_handle import warm_up_requests
from omni.models.hunyuan_image3.build import build_pipeline
from omni.platform_manager import select
from omni.recipe import load_recipe
from omni.request import ImageRequest, TextRequest
from omni.scheduler import Scheduler

recipe = load_recipe("cpu_tiny_instruct").replace_paths({
    "platform": "cuda", "device.kind": "h200", "model.dtype": "bfloat16", "kv_cache.mode": "contiguous",
    "graph.mode": "capture", "serving.compile_first": compile_first})
pipe = build_pipeline(recipe, select("cuda"), progress=False)
graphs = [g for g in (pipe.step_graphs, pipe.vae_graphs, pipe.text_graphs) if g is not None]


def cubins():
    torch.cuda.synchronize()
    return sum(1 for _ in cache.rglob("*.cubin"))


marks = {"built": cubins()}
sched = Scheduler.from_recipe(pipe, recipe)
inner = sched._compile_pass


def watched_pass(requests):
    seconds = inner(requests)
    marks.update(after_pass=cubins(), captures_in_pass=sum(g.captures for g in graphs))
    return seconds


sched._compile_pass = watched_pass
sched.warm_up(*warm_up_requests(prepare(recipe, platform="cuda")))
marks.update(warmed=cubins(), captures=sum(g.captures for g in graphs), compile_pass_s=sched.compile_pass_s)
image = ImageRequest(prompt="a red cat on green grass", steps=3, seed=5, request_id="image")
answer = TextRequest(prompt="what is a fox?", max_tokens=12, temperature=0.0, seed=0, stop_ids=(), request_id="text")
tickets = [sched.submit(image), sched.submit(answer)]
while sched.has_work():
    sched.step()
np.save(out / "image.npy", tickets[0].result().image_HW3)
marks.update(tokens=list(tickets[1].result().token_ids), served=cubins())
print(json.dumps(marks))
"""


def serve(tmp_path: Path, compile_first: bool) -> dict:
    cache, out = tmp_path / f"triton{int(compile_first)}", tmp_path / f"out{int(compile_first)}"
    cache.mkdir(), out.mkdir()
    run = subprocess.run([sys.executable, "-c", SERVER, str(cache), str(int(compile_first)), str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    marks = json.loads(run.stdout.strip().splitlines()[-1])
    return marks | {"image": np.load(out / "image.npy")}


def test_after_the_compile_pass_the_warm_up_compiles_nothing_and_answers_are_unchanged(tmp_path):
    passed, plain = serve(tmp_path, True), serve(tmp_path, False)
    assert passed["compile_pass_s"] > 0 and plain["compile_pass_s"] is None
    assert passed["after_pass"] > passed["built"], "the pass compiled the kernels the warm-up meets"
    assert passed["captures_in_pass"] == 0 and passed["captures"] > 0, "graphs are captured after the pass only"
    assert passed["warmed"] == passed["after_pass"], (
        f"{passed['warmed'] - passed['after_pass']} kernels compiled in the warm-up after the pass")
    assert passed["warmed"] == plain["warmed"], "the pass compiled what the warm-up compiles, no more, no less"
    assert passed["served"] - passed["warmed"] == plain["served"] - plain["warmed"], "serving after it: the same"
    assert passed["tokens"] == plain["tokens"]
    diff = np.abs(passed["image"].astype(int) - plain["image"].astype(int)).max()
    assert passed["image"].shape == plain["image"].shape and diff <= 1, f"images differ by {diff} levels"
