"""The HTTP server end to end: real uvicorn on 127.0.0.1, the tiny model, few steps."""
from __future__ import annotations

import base64
import concurrent.futures
import json
import logging

import httpx
import numpy as np
import pytest
import torch

from serving_harness import FAULT_IN_DECODE, FAULT_IN_STEP, MODEL_ID, png_array, raw_post, wait_until


def generate(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/images/generations", json={"prompt": "a red fox", "seed": 7, **body})


def image_bytes(response: httpx.Response, i: int = 0) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][i]["b64_json"])


# ------------------------------------------------------------------ small endpoints


def test_health_and_models(served):
    c = served.client
    assert c.get("/health").json() == {"status": "ok", "model": MODEL_ID}
    models = c.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL_ID]
    assert c.get(f"/v1/models/{MODEL_ID}").json()["id"] == MODEL_ID
    missing = c.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert missing.headers["x-request-id"] == missing.json()["error"]["request_id"]


def test_metrics_exposes_scheduler_and_latency(served, drained):
    assert generate(served.client).status_code == 200
    text = served.client.get("/metrics").text
    for name in ("omni_queue_depth", "omni_running_requests", "omni_kv_pages_used", "omni_kv_pages_total",
                 "omni_kv_pool_usage_ratio", "omni_request_latency_seconds_bucket", "omni_engine_step_seconds",
                 'omni_stage_seconds_count{stage="denoise"}', 'omni_stage_seconds_count{stage="encode"}',
                 "omni_scheduler_steps_total", 'omni_http_requests_total{endpoint="images",status="200"}'):
        assert name in text, name
    # the device's memory: on the cpu platform, the process's peak RSS, which a served model makes large
    [peak] = [line for line in text.splitlines() if line.startswith("omni_device_memory_peak_bytes ")]
    assert float(peak.split()[1]) > 100 * 2**20


# ------------------------------------------------------------------ images


def test_images_png_with_timings_and_seeds(served, drained):
    r = generate(served.client, n=2, size="1024x1024", return_timings=True, guidance_scale=3.0)
    body = r.json()
    assert r.status_code == 200 and body["size"] == "1024x1024" and body["output_format"] == "png"
    assert [d["seed"] for d in body["data"]] == [7, 8]
    assert image_bytes(r, 0) != image_bytes(r, 1)
    assert png_array(image_bytes(r)).shape == (1024, 1024, 3)
    timings = body["data"][0]["timings"]
    assert set(timings) >= {"queue", "prefill", "denoise", "vae", "encode"}
    assert timings["denoise"] > 0 and timings["encode"] > 0 and body["timings"]["total"] > 0
    again = generate(served.client, n=1, size="1024x1024", guidance_scale=3.0)
    assert image_bytes(again) == image_bytes(r, 0)  # same seed, same image
    assert "timings" not in again.json()["data"][0]


def zlib_level_class(png: bytes) -> int:
    """FLEVEL of the first IDAT's zlib header (RFC 1950): 0 for levels 0-1, 1 for 2-5, 2 for 6, 3 for 7-9."""
    pos = 8  # after the PNG signature: chunks of (length, type, data, crc)
    while True:
        length, kind = int.from_bytes(png[pos:pos + 4], "big"), png[pos + 4:pos + 8]
        if kind == b"IDAT":
            return png[pos + 9] >> 6
        pos += 12 + length


def test_png_level_comes_from_the_recipe(served, tiny_recipe, drained):
    """serving.png_compress_level reaches the encoder: the same pixels, written at zlib level 1 instead of 4."""
    from serving_harness import make_pipeline, serve

    fast = tiny_recipe.replace_paths({"serving.png_compress_level": 1})
    srv, engine = serve(fast, make_pipeline(fast))
    try:
        with srv, httpx.Client(base_url=srv.url, timeout=300) as client:
            level1 = image_bytes(generate(client, size="256x256"))
    finally:
        engine.stop()
    level4 = image_bytes(generate(served.client, size="256x256"))
    assert zlib_level_class(level1) == 0 and zlib_level_class(level4) == 1
    assert np.array_equal(png_array(level1), png_array(level4))


@pytest.mark.parametrize("fmt,magic", [("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
def test_images_output_formats(served, drained, fmt, magic):
    r = generate(served.client, output_format=fmt, output_compression=80)
    assert image_bytes(r).startswith(magic) and r.json()["output_format"] == fmt


@pytest.fixture(scope="module")
def native(tiny_recipe):
    """"WxH" the model generates at for a requested (width, height): its own size rule."""
    from omni import model_registry

    snap = model_registry.get(tiny_recipe.model.flavor).serving_helpers().snap
    return lambda w, h: "{1}x{0}".format(*snap(h, w))


def test_size_is_exact_and_the_native_size_is_reported(served, drained, native, tiny_recipe):
    r = generate(served.client, size="1280x720")  # 16:9: generated on the nearest aspect row, then fitted
    body = r.json()
    assert body["size"] == "1280x720" and png_array(image_bytes(r)).shape == (720, 1280, 3)
    assert body["native_size"] == native(1280, 720) != "1280x720"
    untouched = generate(served.client, size="native").json()
    default_w, default_h = map(int, tiny_recipe.defaults.size.split("x"))
    assert untouched["size"] == untouched["native_size"] == native(default_w, default_h)
    w, h = map(int, untouched["size"].split("x"))
    assert png_array(base64.b64decode(untouched["data"][0]["b64_json"])).shape == (h, w, 3)


def test_size_contract_through_the_openai_client(served, drained, native):
    """The official client gets exactly the size it asked for, a native aspect or not."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    for size, shape in (("256x256", (256, 256, 3)), ("300x200", (200, 300, 3))):
        img = client.images.generate(model=MODEL_ID, prompt="a lighthouse", size=size, response_format="b64_json",
                                     extra_body={"seed": 3, "num_inference_steps": 1})
        assert png_array(base64.b64decode(img.data[0].b64_json)).shape == shape, size
        assert img.size == size and img.native_size == native(*map(int, size.split("x")))


# ------------------------------------------------------------------ chat


def test_chat_completions_returns_a_data_uri(served, drained, native):
    body = {"model": MODEL_ID, "messages": [{"role": "system", "content": "be vivid"},
                                            {"role": "user", "content": [{"type": "text", "text": "a red fox"}]}],
            "modalities": ["image"], "extra_body": {"seed": 7, "size": "512x384", "return_timings": True}}
    r = served.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == MODEL_ID and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    part = choice["message"]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"].startswith("data:image/png;base64,")
    assert set(part["timings"]) >= {"queue", "prefill", "denoise", "vae", "encode"}
    png = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
    assert png_array(png).shape == (384, 512, 3) and part["native_size"] == native(512, 384)


def test_chat_rejects_text_modality(served):
    r = served.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "modalities": ["text"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "modalities"


# ------------------------------------------------------------------ the openai client, unmodified


def test_openai_client(served, drained):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    served.pipeline.real_decode = True  # one image through the real VAE
    try:
        img = client.images.generate(model=MODEL_ID, prompt="a lighthouse", n=1, size="1024x1024",
                                     response_format="b64_json",
                                     extra_body={"seed": 3, "num_inference_steps": 1, "guidance_scale": 1.0})
    finally:
        served.pipeline.real_decode = False
    pixels = png_array(base64.b64decode(img.data[0].b64_json))
    assert pixels.shape == (1024, 1024, 3) and pixels.std() > 1  # a real (noisy) image, not a blank
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "a lighthouse"}],
                                          extra_body={"modalities": ["image"], "seed": 3})
    assert chat.choices[0].message.content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.images.generate(prompt="x", response_format="url")


# ------------------------------------------------------------------ bad input


BAD = [
    (b"{not json", 400, None, "malformed JSON"),
    (b"[1, 2]", 400, None, "must be an object"),
    ({}, 400, "prompt", "prompt"),
    ({"prompt": "   "}, 400, "prompt", "prompt must not be empty"),
    ({"prompt": "x" * 9000}, 400, "prompt", "limit"),
    ({"prompt": "x", "size": "big"}, 400, "size", "size"),
    ({"prompt": "x", "size": "32x32"}, 400, "size", "between"),
    ({"prompt": "x", "size": "4096x512"}, 400, "size", "aspect"),
    ({"prompt": "x", "n": 0}, 400, "n", "n"),
    ({"prompt": "x", "n": 11}, 400, "n", "n"),
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps", "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 1000}, 400, "num_inference_steps", "num_inference_steps"),
    ({"prompt": "x", "guidance_scale": -1}, 400, "guidance_scale", "guidance_scale"),
    ({"prompt": "x", "guidance_scale": "lots"}, 400, "guidance_scale", "guidance_scale"),
    ({"prompt": "x", "seed": -5}, 400, "seed", "seed"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format", "b64_json"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format", "output_format"),
    ({"prompt": "x", "bot_task": "think"}, 400, "bot_task", "needs a model that writes text"),
    ({"prompt": "x", "bot_task": "dance"}, 400, "bot_task", "unknown"),
    ({"prompt": "x", "bot_task": ""}, 400, "bot_task", "unknown"),  # not the default (a fuzzer found it taken)
    ({"prompt": "x", "negative_prompt": ""}, 400, "negative_prompt", "negative_prompt"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unknown field"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model", "not served"),
]


@pytest.mark.parametrize("body,status,field,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_names_the_field(served, body, status, field, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = served.client.post("/v1/images/generations", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field and words in err["message"], err
    assert served.scheduler.queue_depth == 0  # nothing was queued


# ------------------------------------------------------------------ failures, cancellation, overload


def test_failure_returns_500_with_request_id_and_server_keeps_serving(served, drained, caplog):
    caplog.set_level(logging.ERROR, logger="omni")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the good one shares the failing packed step
        bad = pool.submit(generate, served.client, prompt=f"a fox {FAULT_IN_STEP}")
        good = pool.submit(generate, served.client, prompt="a fox", seed=11)
        bad, good = bad.result(), good.result()
    assert bad.status_code == 500
    rid = bad.json()["error"]["request_id"]
    assert rid in bad.json()["error"]["message"] and bad.headers["x-request-id"] == rid
    assert rid in caplog.text and "injected fault" in caplog.text
    assert good.status_code == 200
    assert image_bytes(good) == image_bytes(generate(served.client, prompt="a fox", seed=11))
    decode_fail = generate(served.client, prompt=f"x {FAULT_IN_DECODE}")
    assert decode_fail.status_code == 500
    assert served.client.get("/health").status_code == 200
    assert generate(served.client).status_code == 200


def test_client_disconnect_cancels_and_frees_pages(served, drained):
    sched, pool = served.scheduler, served.pool
    # four images of 200 steps: the server notices a gone client within its 0.2 s poll, and on a loaded 2-core
    # machine one image of the tiny model could finish first (a fresh-clone CI run once saw no cancel)
    body = json.dumps({"prompt": "a long one", "num_inference_steps": 200, "guidance_scale": 4.0, "n": 4}).encode()
    sock = raw_post(served.port, "/v1/images/generations", body)
    wait_until(lambda: sched.num_running >= 1 and pool.free_pages < sched.initial_free_pages, 60, "not admitted")
    sock.close()
    wait_until(lambda: pool.free_pages == sched.initial_free_pages and not sched.has_work(), 60,
               "pages not freed after the client went away")
    assert sched.stats["cancelled"] >= 1


def test_overload_gets_429_with_retry_after(served, drained):
    sched = served.scheduler
    old = sched.max_running, sched.max_queue
    sched.max_running, sched.max_queue = 1, 1
    body = json.dumps({"prompt": "slow", "num_inference_steps": 200}).encode()
    socks = []
    try:
        socks.append(raw_post(served.port, "/v1/images/generations", body))
        wait_until(lambda: sched.num_running == 1, 60, "first request not admitted")
        socks.append(raw_post(served.port, "/v1/images/generations", body))
        wait_until(lambda: sched.queue_depth == 1, 60, "second request not queued")
        r = generate(served.client)
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
    finally:
        for s in socks:
            s.close()
        wait_until(lambda: not sched.has_work(), 60, "cancelled requests not dropped")
        sched.max_running, sched.max_queue = old
    assert 'omni_http_requests_total{endpoint="images",status="429"}' in served.client.get("/metrics").text


def test_request_larger_than_the_whole_pool_is_rejected_at_once(served, monkeypatch):
    monkeypatch.setattr(served.pool, "num_pages", 10)  # a pool too small for any 1024px request
    r = generate(served.client)
    assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"], r.text
    assert served.scheduler.queue_depth == 0


# ------------------------------------------------------------------ batching does not change images


SIZES = ["1024x1024", "1280x768", "768x1280", "512x2048", "2048x512", "1152x896"]


def _mixed(i: int) -> dict:
    return {"prompt": f"scene {i}", "seed": 100 + i, "size": SIZES[i % len(SIZES)],
            "num_inference_steps": 1 + i % 3, "guidance_scale": [1.0, 4.0, 7.5][i % 3]}


def _alone_and_together(served, count: int) -> list[tuple[dict, bytes, bytes]]:
    """(body, PNG alone, PNG while ``count`` mixed requests run concurrently) per request."""
    bodies = [_mixed(i) for i in range(count)]
    alone = [image_bytes(served.client.post("/v1/images/generations", json=b)) for b in bodies]
    calls_before = len(served.pipeline.step_calls)
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        together = list(pool.map(lambda b: served.client.post("/v1/images/generations", json=b), bodies))
    assert max(served.pipeline.step_calls[calls_before:]) > 1, "requests were never packed together"
    return [(b, a, image_bytes(r)) for b, a, r in zip(bodies, alone, together)]


@pytest.fixture
def one_intraop_thread(served):
    """The reference kernels are batch-invariant with one intra-op thread (see omni.scheduler)."""
    served.pipeline.intraop_threads = 1
    yield
    served.pipeline.intraop_threads = torch.get_num_threads()


@pytest.fixture
def all_intraop_threads(served):
    served.pipeline.intraop_threads = torch.get_num_threads()  # the process default (the cores)
    yield


def test_concurrent_mixed_resolutions_match_solo(served, drained, one_intraop_thread):
    for body, alone, together in _alone_and_together(served, 4):
        assert together == alone, f"{body} differs when batched"


def test_concurrent_mixed_resolutions_match_solo_closely_on_all_threads(served, drained, all_intraop_threads):
    for body, alone, together in _alone_and_together(served, 4):
        a, b = latents_of(alone, body), latents_of(together, body)
        assert np.allclose(a, b, rtol=0, atol=1e-4), f"{body}: max diff {np.abs(a - b).max()}"


@pytest.mark.slow
def test_sixteen_concurrent_mixed_resolutions_match_solo(served, drained, one_intraop_thread):
    for body, alone, together in _alone_and_together(served, 16):
        assert together == alone, f"{body} differs when batched"


def latents_of(png: bytes, body: dict) -> np.ndarray:
    """The float32 latents TestPipeline wrote losslessly into the first bytes of the image."""
    w, h = map(int, body["size"].split("x"))
    count = 4 * (h // 16) * (w // 16)  # tiny model: 4 latent channels, 16 px per token (sizes are table rows)
    return np.frombuffer(png_array(png).tobytes()[: 4 * count], dtype=np.float32)
