"""``omni-run edit``: the flags become generate's job with decoded reference images; bad images exit 2 by name.

The hand-over tests replace ``omni.generate.generate_main`` with a recorder (no
model runs); the last test runs the real command on the embedded tiny Instruct
model (``cpu_tiny_instruct``) and reads the PNG it writes.
"""
from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from omni import model_registry
from omni.cli import main

INSTRUCT = "cpu_tiny_instruct"


def write_image(path, w: int, h: int, seed: int = 0, fmt: str = "PNG") -> np.ndarray:
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path, format=fmt)
    return rgb


@pytest.fixture
def handed(monkeypatch):
    """The (deployment, job) pairs ``omni-run edit`` hands to generate_main."""
    import omni.generate

    calls = []
    monkeypatch.setattr(omni.generate, "generate_main", lambda deployment, job: calls.append((deployment, job)) or 0)
    return calls


def test_edit_help_teaches():
    result = subprocess.run([sys.executable, "-m", "omni.cli", "edit", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    out = result.stdout
    assert "examples:" in out and "omni-run edit --recipe cpu_tiny_instruct --image" in out and "--image FILE" in out
    assert "composited onto white" in out and "exit 2" in out


def test_edit_hands_over_the_images_and_the_first_images_size(handed, tmp_path):
    a = write_image(tmp_path / "a.png", 320, 256, seed=1)
    b = write_image(tmp_path / "b.png", 64, 64, seed=2)
    assert main(["edit", "--recipe", INSTRUCT, "--image", str(tmp_path / "a.png"), "--image", str(tmp_path / "b.png"),
                 "--prompt", "put them together", "--steps", "2", "--seed", "5", "--guidance", "1",
                 "-o", str(tmp_path / "out.png")]) == 0
    ((deployment, job),) = handed
    req = job.request
    assert deployment.recipe.name == INSTRUCT and str(job.output) == str(tmp_path / "out.png")
    assert (req.prompt, req.steps, req.seed, req.guidance) == ("put them together", 2, 5, 1.0)
    assert req.template == deployment.recipe.defaults.template == "instruct"
    assert len(req.images) == 2 and np.array_equal(req.images[0], a) and np.array_equal(req.images[1], b)
    helpers = model_registry.get(deployment.recipe.model.flavor).serving_helpers()
    assert (req.height, req.width) == helpers.snap(256, 320)  # generated at the model's snap of image 0
    assert job.output_size == (256, 320)  # and written at image 0's own size (the size contract)


def test_edit_size_flag_wins(handed, tmp_path):
    write_image(tmp_path / "a.jpg", 320, 256, fmt="JPEG")
    assert main(["edit", "--recipe", INSTRUCT, "--image", str(tmp_path / "a.jpg"), "--prompt", "x",
                 "--size", "512x256"]) == 0
    ((_, job),) = handed
    assert (job.request.width, job.request.height) == (512, 256) and job.output_size == (256, 512)


@pytest.mark.parametrize("flag,output", [([], (256, 256)), (["--size", "native"], None), (["--size", "300x200"],
                                                                                          (200, 300))])
def test_generate_writes_exactly_the_size_asked_for(handed, tmp_path, flag, output):
    """No --size: defaults.size exactly; native: the model's own size; WxH: exactly WxH."""
    assert main(["generate", "--recipe", INSTRUCT, "--prompt", "x", *flag]) == 0
    ((_, job),) = handed
    assert job.output_size == output


def _bad_files(tmp_path) -> dict:
    good = tmp_path / "good.png"
    write_image(good, 64, 48)
    data = good.read_bytes()
    (tmp_path / "text.png").write_text("this is not an image")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    (tmp_path / "tiny.png").write_bytes(_png(Image.new("RGB", (8, 8))))
    (tmp_path / "deep.png").write_bytes(_png(Image.fromarray(np.full((32, 32), 40000, dtype=np.uint16))))
    return {"text.png": "not an image", "empty.png": "empty", "cut.png": "is the file complete",
            "tiny.png": "at least 16 pixels", "deep.png": "mode I;16", "missing.png": "No such file"}


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("name", ["text.png", "empty.png", "cut.png", "tiny.png", "deep.png", "missing.png"])
def test_bad_image_exits_2_naming_the_file(handed, tmp_path, capsys, name):
    words = _bad_files(tmp_path)[name]
    path = str(tmp_path / name)
    assert main(["edit", "--recipe", INSTRUCT, "--image", path, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"omni-run: error: --image {path}: ") and words in err, err
    assert not handed


def test_more_images_than_the_model_takes_exit_2(handed, tmp_path, capsys):
    write_image(tmp_path / "a.png", 32, 32)
    args = [a for _ in range(4) for a in ("--image", str(tmp_path / "a.png"))]
    assert main(["edit", "--recipe", INSTRUCT, *args, "--prompt", "x"]) == 2
    assert "4 reference images given; model hunyuan_image3_instruct_tiny takes at most 3" in capsys.readouterr().err
    assert not handed


def test_a_model_that_does_not_edit_exits_2_naming_the_flavour(handed, tmp_path, capsys):
    write_image(tmp_path / "a.png", 32, 32)
    assert main(["edit", "--image", str(tmp_path / "a.png"), "--prompt", "x"]) == 2  # default recipe: cpu_tiny
    err = capsys.readouterr().err
    assert "model hunyuan_image3_tiny does not take reference images" in err and "cpu_tiny_instruct" in err
    assert not handed


def test_the_recipes_pixel_limit_applies(handed, tmp_path, capsys):
    write_image(tmp_path / "a.png", 64, 48)
    recipe = tmp_path / "cpu_small.yaml"
    recipe.write_text("name: cpu_small\nplatform: cpu\nmodel: {flavor: hunyuan_image3_instruct_tiny, dtype: float32}\n"
                      "serving: {max_image_pixels: 1024}\n")
    assert main(["edit", "--recipe", str(recipe), "--image", str(tmp_path / "a.png"), "--prompt", "x"]) == 2
    assert "is 3072 pixels; the limit is 1024 (serving.max_image_pixels)" in capsys.readouterr().err


def test_image_flag_is_required(capsys):
    assert main(["edit", "--prompt", "x"]) == 2
    assert "--image" in capsys.readouterr().err


def test_edit_end_to_end_writes_a_png(tmp_path):
    write_image(tmp_path / "ref.png", 256, 256, seed=3)
    out = tmp_path / "edited.png"
    result = subprocess.run([sys.executable, "-m", "omni.cli", "edit", "--recipe", INSTRUCT, "--image",
                             str(tmp_path / "ref.png"), "--prompt", "make it blue", "--steps", "2", "--seed", "1",
                             "--guidance", "1", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out} (edit of 1 image(s), " in result.stdout
    helpers = model_registry.get("hunyuan_image3_instruct_tiny").serving_helpers()
    h, w = helpers.snap(256, 256)
    pixels = np.asarray(Image.open(out))
    assert pixels.shape == (h, w, 3) and pixels.std() > 1  # a real (noisy) image through the real VAE


def test_generate_end_to_end_writes_the_requested_size_and_says_the_native_one(tmp_path, capsys):
    out = tmp_path / "wide.png"
    assert main(["generate", "--recipe", INSTRUCT, "--prompt", "a red fox", "--size", "300x200", "--steps", "1",
                 "--guidance", "1", "--seed", "2", "-v", "-o", str(out)]) == 0
    assert Image.open(out).size == (300, 200)
    printed = capsys.readouterr().out
    assert "native size " in printed and "fitted to 300x200 (centre crop to the aspect, Lanczos)" in printed
    assert "(300x200, 1 steps, seed 2" in printed
