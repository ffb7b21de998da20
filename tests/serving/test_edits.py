"""POST /v1/images/edits over a real localhost server, driven by the official openai client and raw multipart.

Three servers:

- ``editing``: the real tiny (base) engine behind helpers that take 3 reference
  images, and a 1 MiB per-image byte limit: every refusal (4xx naming the part or
  field) comes before the engine, so no editing model is needed for them;
  beside it the same engine with the tiny flavour's own helpers (max_images 0),
  to show a model that does not edit refuses images by name;
- ``recorded``: the model-free ``FakePipeline`` recording the requests it is
  handed, to check the decoded images reach ``ImageRequest.images`` pixel-exact,
  in upload order, shared by n requests, and that "auto" follows image 0;
- ``instruct``: recipe ``cpu_tiny_instruct`` with the random-weight tiny Instruct flavour,
  end to end with the openai client, 1 and 3 images (fake VAE decode, 2 steps).
"""
from __future__ import annotations

import base64
import dataclasses
import io
import struct
import zlib
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from omni import model_registry
from omni.engine_loop import EngineLoop
from omni.platform_manager import select
from omni.recipe import load_recipe
from omni.scheduler import Scheduler
from omni.serving.app import ModelHelpers, ServingOptions, create_app

from serving_harness import MODEL_ID, FakePipeline, ServerThread, TestPipeline, make_pipeline, png_array


openai = pytest.importorskip("openai")

IMAGE_LIMIT = 1 << 20  # per-image bytes on the ``editing`` server (the default is 20 MiB)
INSTRUCT_RECIPE = "cpu_tiny_instruct"


# ------------------------------------------------------------------ images to upload


def image_file(w: int, h: int, seed: int = 0, mode: str = "RGB", fmt: str = "PNG") -> tuple[np.ndarray, bytes]:
    """(the RGB pixels the server should decode, the encoded file) of a random ``w`` x ``h`` image."""
    rgb = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    im = Image.fromarray(rgb)
    if mode != "RGB":
        im = im.convert(mode)
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    data = buf.getvalue()
    return (np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) if mode != "RGB" else rgb), data


def png_with_header(w: int, h: int) -> bytes:
    """A PNG whose header claims ``w`` x ``h`` with almost no pixel data (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def sixteen_bit_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32), 40000, dtype=np.uint16)).save(buf, format="PNG")
    return buf.getvalue()


def tiff() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="TIFF")
    return buf.getvalue()


GOOD = image_file(64, 48)[1]
JPEG = image_file(64, 48, fmt="JPEG")[1]


def edit(client: httpx.Client, images: list[bytes], field: str = "image[]", **data) -> httpx.Response:
    files = [(field, (f"in{i}.png", blob, "image/png")) for i, blob in enumerate(images)]
    return client.post("/v1/images/edits", files=files, data={"prompt": "make it blue", "seed": "7", **data})


def sdk(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


# ------------------------------------------------------------------ servers


@pytest.fixture(scope="module")
def editing(tiny_recipe):
    """(url of the tiny engine with 3-image helpers, url of the same engine with its own helpers: no editing)."""
    pipeline = make_pipeline(tiny_recipe)
    engine = EngineLoop.around(Scheduler.from_recipe(pipeline, tiny_recipe)).start()
    assert engine.wait_ready(30)
    tiny = model_registry.get("hunyuan_image3_tiny").serving_helpers()
    edits = ServingOptions.from_recipe(tiny_recipe, model_id=MODEL_ID, max_image_bytes=IMAGE_LIMIT,
                                       helpers=dataclasses.replace(tiny, max_images=3))
    plain = ServingOptions.from_recipe(tiny_recipe, model_id=MODEL_ID)
    with ServerThread(create_app(engine, edits)) as srv, ServerThread(create_app(engine, plain)) as base:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            yield SimpleNamespace(url=srv.url, base_url=base.url, client=client, scheduler=engine.scheduler)
    engine.stop()


class RecordingPipeline(FakePipeline):
    """FakePipeline that keeps every request it admits and decodes to the request's size (zeros)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests = []

    def admit(self, req):
        self.requests.append(req)
        return super().admit(req)

    def decode(self, state) -> torch.Tensor:
        return torch.zeros((state.request.height, state.request.width, 3), dtype=torch.uint8)


def recording_server(max_images: int = 3, **options):
    """(server thread, engine, pipeline): the model-free engine behind helpers that take ``max_images`` images."""
    pipe = RecordingPipeline(num_pages=8192)
    engine = EngineLoop.around(Scheduler(pipe, max_running=4)).start()
    assert engine.wait_ready(10)
    helpers = dataclasses.replace(ModelHelpers.plain(), max_images=max_images)
    return ServerThread(create_app(engine, ServingOptions(model_id="fake-edit", helpers=helpers, **options))), \
        engine, pipe


@pytest.fixture(scope="module")
def recorded():
    srv, engine, pipe = recording_server()
    with srv:
        yield srv.url, pipe
    engine.stop()


@pytest.fixture(scope="module")
def instruct():
    """The tiny Instruct architecture with random weights behind a real server (2 steps, no CFG, fake VAE
    decode; served under the embedded model's name). The text tests read its greedy answers, which the
    trained checkpoint (tests/test_quality_tiny_edit.py) does not share."""
    recipe = load_recipe(INSTRUCT_RECIPE).replace_paths({
        "model.flavor": "hunyuan_image3_instruct_tiny_random", "kv_cache.budget_bytes": 160 << 20,
        "serving.max_batch_tokens": 1 << 17, "serving.max_running": 8,
        "serving.max_queue": 32, "defaults.steps": 2, "defaults.guidance": 1.0})
    flavor = model_registry.get(recipe.model.flavor)
    pipeline = TestPipeline(flavor.build_pipeline(recipe, select("cpu"), progress=False))
    engine = EngineLoop.around(Scheduler.from_recipe(pipeline, recipe)).start()
    assert engine.wait_ready(60)
    options = ServingOptions.from_recipe(recipe, model_id="hunyuan_image3_instruct_tiny")
    with ServerThread(create_app(engine, options)) as srv:
        yield srv.url, options, engine.scheduler
    engine.stop()


# ------------------------------------------------------------------ the images reach the requests


def test_openai_client_edit_hands_the_decoded_images_over_in_order(recorded):
    url, pipe = recorded
    arrays, files = zip(*(image_file(40 + 8 * i, 32, seed=i) for i in range(3)))
    before = len(pipe.requests)
    out = sdk(url).images.edit(image=[(f"{i}.png", f, "image/png") for i, f in enumerate(files)], prompt="swap",
                               n=2, size="512x256", extra_body={"seed": 5, "num_inference_steps": 2})
    assert [d.seed for d in out.data] == [5, 6] and out.size == "512x256"
    assert png_array(base64.b64decode(out.data[0].b64_json)).shape == (256, 512, 3)
    reqs = pipe.requests[before:]
    assert len(reqs) == 2 and [r.steps for r in reqs] == [2, 2]
    for req in reqs:  # n requests share the same images, pixel-exact and in upload order
        assert len(req.images) == 3
        for got, want in zip(req.images, arrays):
            assert got.dtype == np.uint8 and got.flags.c_contiguous and np.array_equal(got, want)


def test_one_image_as_a_bare_image_field_and_auto_size_follows_it(recorded):
    url, pipe = recorded
    pixels, blob = image_file(320, 256)
    out = sdk(url).images.edit(image=("one.png", blob, "image/png"), prompt="x", size="auto")
    assert out.size == "320x256"  # the plain helpers snap nothing: image 0's own size
    assert np.array_equal(pipe.requests[-1].images[0], pixels)
    with httpx.Client(base_url=url) as c:  # curl's -F image=@a.png -F image=@b.png; no size at all
        r = c.post("/v1/images/edits",
                   files=[("image", ("a.png", image_file(288, 256)[1])), ("image", ("b.png", blob))],
                   data={"prompt": "x", "num_inference_steps": "2", "return_timings": "true", "negative_prompt": ""})
    assert r.status_code == 200, r.text
    assert r.json()["size"] == "288x256" and "timings" in r.json()["data"][0]
    req = pipe.requests[-1]
    assert len(req.images) == 2 and np.array_equal(req.images[1], pixels) and req.negative_prompt is None


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "LA", "CMYK"])
def test_eight_bit_modes_become_rgb(recorded, mode):
    url, pipe = recorded
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    expected, blob = image_file(32, 32, mode=mode, fmt=fmt)
    with httpx.Client(base_url=url) as c:
        r = c.post("/v1/images/edits", files=[("image", ("m", blob))], data={"prompt": "x", "size": "256x256"})
    assert r.status_code == 200, r.text
    assert pipe.requests[-1].images[0].shape == (32, 32, 3)
    assert np.array_equal(pipe.requests[-1].images[0], expected)


def test_alpha_is_composited_onto_white(recorded):
    url, pipe = recorded
    rgba = np.zeros((16, 32, 4), dtype=np.uint8)
    rgba[..., 0] = 255
    rgba[:, 16:, 3] = 255  # left half transparent red-under-alpha, right half opaque red
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    with httpx.Client(base_url=url) as c:
        r = c.post("/v1/images/edits", files=[("image", ("a.png", buf.getvalue()))],
                   data={"prompt": "x", "size": "256x256"})
    assert r.status_code == 200, r.text
    got = pipe.requests[-1].images[0]
    assert (got[:, :16] == 255).all() and (got[:, 16:] == [255, 0, 0]).all()


# ------------------------------------------------------------------ refusals: 4xx naming the part or field


BAD = [
    # (images, extra form fields, image field name, status, param, words in the message)
    ([b""], {}, "image[]", 400, "image[0]", "empty"),
    ([b"just some text, named .png"], {}, "image[]", 400, "image[0]", "not an image"),
    ([GOOD[: len(GOOD) // 2]], {}, "image[]", 400, "image[0]", "complete"),
    ([GOOD[:-20]], {}, "image[]", 400, "image[0]", "complete"),  # pixels all there, the PNG's checksum cut off
    ([JPEG[: len(JPEG) // 2]], {}, "image[]", 400, "image[0]", "complete"),
    ([png_with_header(100_000, 100_000)], {}, "image[]", 400, "image[0]", "too many pixels"),
    ([png_with_header(5000, 5000)], {}, "image[]", 400, "image[0]", "the limit is 16777216"),
    ([image_file(8, 64)[1]], {}, "image[]", 400, "image[0]", "at least 16 pixels"),
    ([image_file(16, 160)[1]], {}, "image[]", 400, "image[0]", "aspect ratio"),
    ([sixteen_bit_png()], {}, "image[]", 400, "image[0]", "mode I;16"),
    ([tiff()], {}, "image[]", 400, "image[0]", "not one of PNG, JPEG"),
    ([GOOD, GOOD, b"nope"], {}, "image[]", 400, "image[2]", "not an image"),
    ([GOOD] * 4, {}, "image[]", 400, "image[3]", "at most 3"),
    ([GOOD] * 4, {}, "image", 400, "image[3]", "at most 3"),
    ([b"\0" * (IMAGE_LIMIT + 1)], {}, "image[]", 413, "image[0]", "bytes per image"),
    ([GOOD], {"size": "big"}, "image[]", 400, "size", "size"),
    ([GOOD], {"size": "32x32"}, "image[]", 400, "size", "between"),
    ([GOOD], {"n": "0"}, "image[]", 400, "n", "n"),
    ([GOOD], {"n": "many"}, "image[]", 400, "n", "integer"),
    ([GOOD], {"response_format": "url"}, "image[]", 400, "response_format", "b64_json"),
    ([GOOD], {"stream": "true"}, "image[]", 400, "stream", "stream"),
    ([GOOD], {"guidance_scale": "lots"}, "image[]", 400, "guidance_scale", "guidance_scale"),
    ([GOOD], {"num_inference_steps": "0"}, "image[]", 400, "num_inference_steps", "num_inference_steps"),
    ([GOOD], {"output_format": "gif"}, "image[]", 400, "output_format", "output_format"),
    ([GOOD], {"prompt": ""}, "image[]", 400, "prompt", "prompt must not be empty"),
    ([GOOD], {"prompt": "x" * 9000}, "image[]", 400, "prompt", "limit"),
    ([GOOD], {"frobnicate": "1"}, "image[]", 400, "frobnicate", "unknown field"),
    ([GOOD], {"model": "dall-e-2"}, "image[]", 404, "model", "not served"),
]


@pytest.mark.parametrize("images,fields,name,status,param,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_edit_names_the_part(editing, images, fields, name, status, param, words):
    r = edit(editing.client, images, name, **fields)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert editing.scheduler.queue_depth == 0 and not editing.scheduler.has_work()


def test_truncated_data_is_never_loaded_leniently(editing):
    from PIL import ImageFile

    assert edit(editing.client, [GOOD[: len(GOOD) // 2]]).status_code == 400
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False  # nothing in the server turned Pillow's lenient mode on


def test_no_image_at_all_is_named(editing):
    with pytest.raises(openai.BadRequestError, match="no reference image") as info:
        sdk(editing.url).images.edit(image=[], prompt="x")  # the SDK still sends multipart/form-data
    assert info.value.body["param"] == "image"


def test_mask_is_refused_by_name(editing):
    r = editing.client.post("/v1/images/edits", files=[("image", ("a.png", GOOD)), ("mask", ("m.png", GOOD))],
                            data={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mask" and "mask" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="mask is not supported"):
        sdk(editing.url).images.edit(image=("a.png", GOOD), mask=("m.png", GOOD), prompt="x")


def test_an_image_sent_as_a_text_field_is_named(editing):
    r = editing.client.post("/v1/images/edits", data={"prompt": "x", "image": "cat.png"},  # fields go first
                            files=[("image[]", ("a.png", GOOD))])
    assert r.status_code == 400 and r.json()["error"]["param"] == "image[0]"
    assert "expected a file upload" in r.json()["error"]["message"]


def test_not_multipart_or_malformed_multipart_is_400(editing):
    c = editing.client
    r = c.post("/v1/images/edits", json={"prompt": "x", "image": "data:image/png;base64,AAAA"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "image"
    r = c.post("/v1/images/edits", content=b"--x\r\n", headers={"content-type": "multipart/form-data"})
    assert r.status_code == 400 and "boundary" in r.json()["error"]["message"]
    r = c.post("/v1/images/edits", content=b"--zz\r\nContent-Disposition: form-data\r\n\r\nx\r\n--zz--\r\n",
               headers={"content-type": "multipart/form-data; boundary=zz"})
    assert r.status_code == 400, r.text  # a part without a name


def test_too_large_upload_is_413_not_500(editing):
    big = b"\0" * (5 * IMAGE_LIMIT)  # past the whole body's limit (3 images + 1 MiB), read and dropped
    r = edit(editing.client, [big])
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"], r.text
    assert editing.client.get("/health").status_code == 200


def test_openai_client_sees_bad_images_as_bad_request(editing):
    client = sdk(editing.url)
    with pytest.raises(openai.BadRequestError, match=r"image\[1\]"):
        client.images.edit(image=[("a.png", GOOD), ("b.png", b"not an image")], prompt="x")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.images.edit(image=("a.png", GOOD), prompt="x", response_format="url")


def test_a_model_that_does_not_edit_refuses_any_image(editing):
    with httpx.Client(base_url=editing.base_url) as c:
        r = edit(c, [GOOD])
        assert r.status_code == 400 and r.json()["error"]["param"] == "image[0]", r.text
        assert f"model {MODEL_ID} does not take reference images" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="does not take reference images"):
        sdk(editing.base_url).images.edit(image=[], prompt="x")


# ------------------------------------------------------------------ the tiny Instruct model, end to end


def test_instruct_takes_three_images(instruct):
    _, options, _ = instruct
    assert options.helpers.max_images == 3


def test_instruct_edit_one_image_round_trip(instruct):
    url, options, scheduler = instruct
    pixels, blob = image_file(256, 256, seed=1)
    client = sdk(url)
    out = client.images.edit(model=options.model_id, image=("cat.png", blob, "image/png"), prompt="make it blue",
                             size="256x256", extra_body={"seed": 11, "num_inference_steps": 2})
    h, w = options.helpers.snap(256, 256)
    assert out.size == f"{w}x{h}" and out.data[0].seed == 11
    first = base64.b64decode(out.data[0].b64_json)
    assert png_array(first).shape == (h, w, 3)
    again = client.images.edit(model=options.model_id, image=("cat.png", blob, "image/png"), prompt="make it blue",
                               size="256x256", extra_body={"seed": 11, "num_inference_steps": 2})
    assert base64.b64decode(again.data[0].b64_json) == first  # same seed, same image: same output
    other = client.images.edit(model=options.model_id, image=("dog.png", image_file(256, 256, seed=2)[1]),
                               prompt="make it blue", size="256x256", extra_body={"seed": 11, "num_inference_steps": 2})
    assert base64.b64decode(other.data[0].b64_json) != first  # the reference image conditions the output
    assert not scheduler.has_work()


def test_instruct_edit_three_images_and_auto_size(instruct):
    url, options, _ = instruct
    files = [(f"{i}.png", image_file(320, 256, seed=i)[1], "image/png") for i in range(3)]
    out = sdk(url).images.edit(image=files, prompt="combine them", n=2,
                               extra_body={"seed": 4, "num_inference_steps": 2})
    h, w = options.helpers.snap(256, 320)  # no size: generated at the first image's snap, returned at its size
    assert out.size == "320x256" and out.native_size == f"{w}x{h}" and [d.seed for d in out.data] == [4, 5]
    assert png_array(base64.b64decode(out.data[0].b64_json)).shape == (256, 320, 3)
    sized = sdk(url).images.edit(image=files[:1], prompt="wider", size="300x200",
                                 extra_body={"seed": 4, "num_inference_steps": 1})
    assert sized.size == "300x200" and png_array(base64.b64decode(sized.data[0].b64_json)).shape == (200, 300, 3)
    assert out.data[0].b64_json != out.data[1].b64_json
    with pytest.raises(openai.BadRequestError, match=r"image\[3\].*at most 3"):
        sdk(url).images.edit(image=files + [files[0]], prompt="four")


def test_the_openapi_document_states_what_an_instruct_server_refuses():
    """What schemathesis found on the tiny Instruct server (OMNI_FUZZ_RECIPE=cpu_tiny_instruct): the document
    offered ``cot_max_tokens`` without a CoT task, and nulls in the edit form (sent as the text "null"), both
    refused with a 400. The document now pairs the CoT fields (if / then) and the form has no null."""
    import jsonschema

    pipe = RecordingPipeline(num_pages=8192)
    engine = EngineLoop.around(Scheduler(pipe, max_running=4)).start()
    assert engine.wait_ready(10)
    helpers = dataclasses.replace(ModelHelpers.plain(), max_images=3, writes_text=True)
    with ServerThread(create_app(engine, ServingOptions(model_id="fake-edit", helpers=helpers))) as srv, \
            httpx.Client(base_url=srv.url) as c:
        doc = c.get("/openapi.json").json()
        body = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]
        valid = jsonschema.Draft202012Validator(body["schema"]).is_valid
        for fields in ({"cot_max_tokens": 8}, {"cot_max_tokens": 8, "bot_task": "image"}, {"drop_think": True},
                       {"drop_think": True, "bot_task": "recaption"}):
            assert not valid({"prompt": "x", **fields}), fields
            r = c.post("/v1/images/generations", json={"prompt": "x", **fields})
            assert r.status_code == 400 and r.json()["error"]["param"] in fields, (fields, r.text)
        for fields in ({"cot_max_tokens": 8, "bot_task": "think"}, {"drop_think": True, "bot_task": "think_recaption"},
                       {"drop_think": False, "cot_max_tokens": None}):
            assert valid({"prompt": "x", **fields}), fields
        assert c.post("/v1/images/generations", json={"prompt": "x", "drop_think": False, "cot_max_tokens": None,
                                                        "num_inference_steps": 1}).status_code == 200
        form = doc["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        nulls = {k for k, v in form["properties"].items() if "null" in str(v.get("anyOf", v.get("type")))}
        assert not nulls and "default" not in form["properties"]["seed"], nulls
    engine.stop()


def test_the_openapi_document_describes_the_edit_forms_image_part(instruct):
    """The edit form's image file part is in the document: required, its encoding naming the formats the server
    decodes, and the rules JSON Schema cannot state (sides, pixels, aspect, count, the ``image[]`` spelling) in
    its description. Without it schemathesis sent forms with no image, schema-valid requests that the server
    refused. A form built from the documented parts, with a real PNG, is accepted; without its image both the
    schema and the server refuse it; an empty optional field is allowed by both (read as absent)."""
    import jsonschema

    url, options, _ = instruct
    with httpx.Client(base_url=url, timeout=300) as c:
        form = c.get("/openapi.json").json()["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"][
            "multipart/form-data"]
        schema, image = form["schema"], form["schema"]["properties"]["image"]
        assert {"image", "prompt"} <= set(schema["required"])
        # 1 to 3 files, stated exactly: an array of files, sent as repeated parts (one file is the 1-item array)
        assert image["type"] == "array" and (image["minItems"], image["maxItems"]) == (1, 3)
        assert image["items"] == {"type": "string", "contentMediaType": "application/octet-stream"}
        types = [t.strip() for t in form["encoding"]["image"]["contentType"].split(",")]
        assert types == ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"]
        for rule in ("1 to 3 files", "repeated ``image`` parts", "``image[]``", "``image[3]``", "at least 16 px",
                     f"at most {options.max_image_pixels} pixels", "aspect ratio at most 8:1",
                     f"at most {options.max_image_bytes} bytes"):
            assert rule in image["description"], rule
        fields = {"prompt": "make it blue", "num_inference_steps": 1, "seed": 3, "size": "", "n": ""}
        valid = jsonschema.Draft202012Validator(schema).is_valid
        for k in (1, 2, 3):
            assert valid({**fields, "image": ["a file"] * k}), k
        assert not valid({**fields, "image": ["a file"] * 4}) and not valid({**fields, "image": []})
        assert not valid(fields)
        text_parts = [(name, (None, str(value))) for name, value in fields.items()]  # a form's values are text
        r = c.post("/v1/images/edits", files=text_parts + [("image", ("image.png", image_file(64, 64)[1], types[0]))])
        assert r.status_code == 200 and r.json()["size"] == "64x64" and len(r.json()["data"]) == 1, r.text
        r = c.post("/v1/images/edits", files=text_parts)
        assert r.status_code == 400 and r.json()["error"]["param"] == "image", r.text


@pytest.mark.parametrize("max_images", [1, 2, 3])
def test_the_edit_forms_file_count_is_what_the_document_allows(max_images):
    """The served document's ``image`` against the server, 1 to max_images + 1 files sent as repeated plain
    ``image`` parts (curl's -F image=@a.png -F image=@b.png): a form the document allows is accepted and the
    pipeline gets that many references, pixel-exact and in upload order; one more file the document refuses
    and the server answers 400 naming it (``image[max_images]``). Before, the document gave the form one file,
    so that a fuzzer or a client generator never sent two; with max_images 1 it stays a single file."""
    import jsonschema

    srv, engine, pipe = recording_server(max_images)
    arrays, blobs = zip(*(image_file(64 + 16 * i, 48, seed=i) for i in range(max_images + 1)))
    with srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        form = c.get("/openapi.json").json()["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"][
            "multipart/form-data"]
        image = form["schema"]["properties"]["image"]
        if max_images == 1:
            assert image["type"] == "string" and image["contentMediaType"] == "application/octet-stream"
            assert "one file" in image["description"]
        else:
            assert (image["type"], image["minItems"], image["maxItems"]) == ("array", 1, max_images)
        valid = jsonschema.Draft202012Validator(form["schema"]).is_valid
        fields = {"prompt": "make it blue", "num_inference_steps": 2, "seed": 7}
        for k in range(1, max_images + 2):
            files = ["a file"] * k
            allowed = valid({**fields, "image": files[0] if max_images == 1 and k == 1 else files})
            r = c.post("/v1/images/edits", data={name: str(value) for name, value in fields.items()},
                       files=[("image", (f"{i}.png", blobs[i], "image/png")) for i in range(k)])
            if k <= max_images:
                assert allowed and r.status_code == 200, (k, r.text)
                got = pipe.requests[-1].images
                assert len(got) == k and all(np.array_equal(g, a) for g, a in zip(got, arrays)), k
            else:
                assert not allowed and r.status_code == 400, (k, r.text)
                err = r.json()["error"]
                assert err["param"] == f"image[{max_images}]" and f"at most {max_images}" in err["message"], err
    engine.stop()


def test_the_openapi_document_states_where_a_chat_takes_images_and_how_many(instruct):
    """What schemathesis found on the tiny Instruct server: the document offered image_url parts in any message
    (the server takes them from user messages only) with any object as the image. Now: user messages only, the
    URL a data URI of an image (its rules in the description, its format named for a fuzzer), and at most
    ``max_images`` of them over all the messages. The document and the server agree on each case below."""
    import jsonschema

    url, options, _ = instruct
    png = "data:image/png;base64," + base64.b64encode(image_file(64, 64)[1]).decode()

    def user(*parts, role="user"):
        return {"role": role, "content": [{"type": "text", "text": "make it blue"}, *parts]}

    def image(value=png):
        return {"type": "image_url", "image_url": value}

    with httpx.Client(base_url=url, timeout=300) as c:
        schema = c.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
            "application/json"]["schema"]
        valid = jsonschema.Draft202012Validator(schema).is_valid
        refused = {"messages[0].content[1]": [user(image(), role="system"), user()],
                   "messages[0].content[2]": [user(image(), image({"detail": "low"}))],
                   "messages[1].content[2]": [user(image(), image()), user(image(), image())]}
        for param, messages in refused.items():
            body = {"messages": messages, "num_inference_steps": 1}
            r = c.post("/v1/chat/completions", json=body)
            assert not valid(body) and r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
        body = {"messages": [user(image(), image({"url": png})), user(image())], "num_inference_steps": 1}
        assert valid(body) and options.helpers.max_images == 3
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"][0]["type"] == "image_url", r.text
        url_schema = schema["properties"]["messages"]["items"]["anyOf"][0]["properties"]["content"]["anyOf"][1][
            "items"]["anyOf"][1]["properties"]["image_url"]["anyOf"][0]
        assert url_schema["format"] == "image-uri" and "at least 16 px" in url_schema["description"]


def test_a_servers_cot_cap_is_in_the_document_and_held():
    """``max_cot_tokens`` (the fuzz server's 128) caps ``cot_max_tokens`` as ``max_steps`` caps the steps: the
    document's maximum, a 400 above it, and the budget of a request that gives none."""
    from omni.request import COT_BUDGET
    from omni.serving.errors import APIError
    from omni.serving.schemas import ImageGenerationRequest
    from omni.serving.validation import RequestBuilder

    helpers = dataclasses.replace(ModelHelpers.plain(), writes_text=True)
    pipe = RecordingPipeline(num_pages=64)
    engine = EngineLoop.around(Scheduler(pipe, max_running=1)).start()
    assert engine.wait_ready(10)
    options = ServingOptions(model_id="fake-cot", helpers=helpers, max_cot_tokens=64)
    with ServerThread(create_app(engine, options)) as srv, httpx.Client(base_url=srv.url) as c:
        schema = c.get("/openapi.json").json()["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"][
            "application/json"]["schema"]
        assert schema["properties"]["cot_max_tokens"]["anyOf"][0]["maximum"] == 64
        r = c.post("/v1/images/generations", json={"prompt": "x", "bot_task": "think", "cot_max_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cot_max_tokens", r.text
    engine.stop()

    def budget(opts: ServingOptions, **fields) -> int:
        builder = RequestBuilder(opts, helpers)
        body = ImageGenerationRequest(prompt="x", bot_task="think", **fields)
        return builder.requests("r", body, "x", 1, builder.size(None, "size"), None)[0].cot_max_tokens

    assert budget(options) == 64 and budget(options, cot_max_tokens=10) == 10
    assert budget(ServingOptions(model_id="m", helpers=helpers)) == COT_BUDGET
    with pytest.raises(APIError, match="above this server's limit of 64"):
        budget(options, cot_max_tokens=65)
