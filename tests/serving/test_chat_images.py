"""Chat completions with ``image_url`` parts: reference images from data URIs (or fetched URLs, when allowed).

The requests reach the model-free recording engine of test_edits.py (helpers
taking 3 images), so the checks see exactly which pixels were handed over; the
base tiny model (``cpu_tiny``) shows that a model that does not edit refuses a
part by name; the tiny Instruct model answers a chat edit end to end. Remote
URLs are fetched from a real ``http.server`` on 127.0.0.1.
"""
from __future__ import annotations

import base64
import http.server
import json
import threading
import time

import httpx
import numpy as np
import pytest

from omni.recipe import load_recipe
from omni.serving.app import ServingOptions

from serving_harness import png_array

import test_edits
from test_edits import IMAGE_LIMIT, image_file, recording_server, sdk

instruct = test_edits.instruct  # the tiny Instruct server fixture (module scope: one per module)

openai = pytest.importorskip("openai")

A_PIXELS, A_PNG = image_file(320, 256, seed=10)
B_PIXELS, B_PNG = image_file(48, 64, seed=11)


def data_uri(blob: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(blob).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(client: httpx.Client, messages: list, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": messages, "modalities": ["image"],
                                                     "num_inference_steps": 2, **extra})


@pytest.fixture(scope="module")
def recorded():
    srv, engine, pipe = recording_server(max_image_bytes=IMAGE_LIMIT)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        yield srv.url, client, pipe
    engine.stop()


# ------------------------------------------------------------------ a localhost image host


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/a.png":
            return self._send(200, A_PNG)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
            return None
        if self.path == "/big":
            return self._send(200, b"\0" * (IMAGE_LIMIT + 1))
        if self.path == "/slow":
            time.sleep(2)
            return self._send(200, A_PNG)
        return self._send(404, b"no such image")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server gave up on a slow or too large answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    host.daemon_threads = True
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_address[1]}"
    host.shutdown()


@pytest.fixture(scope="module")
def fetching():
    srv, engine, pipe = recording_server(max_image_bytes=IMAGE_LIMIT, fetch_remote_images=True, fetch_timeout_s=0.5)
    with srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client, pipe
    engine.stop()


# ------------------------------------------------------------------ image parts become reference images


def test_image_parts_of_user_messages_are_the_images_in_message_order(recorded):
    _, client, pipe = recorded
    messages = [{"role": "system", "content": "you edit photos"},
                {"role": "user", "content": [{"type": "text", "text": "put the fox"}, image_part(data_uri(A_PNG))]},
                {"role": "assistant", "content": "which background?"},
                {"role": "user", "content": [{"type": "image_url", "image_url": data_uri(B_PNG, "image/x-whatever")},
                                             {"type": "text", "text": "on this background"}]}]
    r = chat(client, messages, seed=3, n=2)
    assert r.status_code == 200, r.text
    urls = [part["image_url"]["url"] for part in r.json()["choices"][0]["message"]["content"]]
    assert len(urls) == 2 and png_array(base64.b64decode(urls[0].split(",", 1)[1])).shape == (256, 320, 3)
    for req in pipe.requests[-2:]:  # both outputs edit the same two images; the size follows image 0
        assert req.prompt == "put the fox on this background" and req.system_prompt == "you edit photos"
        assert (req.height, req.width) == (256, 320)
        assert len(req.images) == 2
        assert np.array_equal(req.images[0], A_PIXELS) and np.array_equal(req.images[1], B_PIXELS)


def test_explicit_size_wins_over_the_reference(recorded):
    _, client, pipe = recorded
    r = chat(client, [{"role": "user", "content": [image_part(data_uri(A_PNG)), {"type": "text", "text": "x"}]}],
             size="512x512")
    assert r.status_code == 200, r.text
    assert (pipe.requests[-1].height, pipe.requests[-1].width) == (512, 512)


def test_openai_client_chat_with_an_image(recorded):
    url, _, pipe = recorded
    out = sdk(url).chat.completions.create(
        model="fake-edit", messages=[{"role": "user", "content": [{"type": "text", "text": "make it snow"},
                                                                  image_part(data_uri(B_PNG))]}],
        extra_body={"modalities": ["image"], "seed": 1, "num_inference_steps": 2})
    assert out.choices[0].message.content[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert np.array_equal(pipe.requests[-1].images[0], B_PIXELS)


def _text(text: str = "x") -> dict:
    return {"type": "text", "text": text}


BAD = [
    # (content of messages[0] (a user message unless stated), status, param, words)
    ([_text(), image_part("data:image/png;base64,@@not base64@@")], 400, "messages[0].content[1]", "base64"),
    ([_text(), image_part(data_uri(b"plain text, not a picture"))], 400, "messages[0].content[1]", "not an image"),
    ([_text(), image_part(data_uri(A_PNG[: len(A_PNG) // 2]))], 400, "messages[0].content[1]", "complete"),
    ([_text(), image_part("data:,")], 400, "messages[0].content[1]", "empty"),
    ([_text(), image_part("data:image/png;base64")], 400, "messages[0].content[1]", "malformed data URI"),
    ([_text(), image_part("https://example.com/cat.png")], 400, "messages[0].content[1]", "fetch_remote_images"),
    ([_text(), image_part("file:///etc/passwd")], 400, "messages[0].content[1]", "scheme 'file'"),
    ([_text(), {"type": "image_url", "image_url": {"detail": "high"}}], 400, "messages[0].content[1]", "expected"),
    ([_text(), {"type": "input_audio", "input_audio": {}}], 400, "messages[0].content[1]", "'input_audio'"),
    ([_text(), *[image_part(data_uri(B_PNG))] * 4], 400, "messages[0].content[4]", "at most 3"),
    ([_text(), image_part(data_uri(b"\0" * (2 * IMAGE_LIMIT)))], 413, "messages[0].content[1]", "limit per image"),
]


@pytest.mark.parametrize("content,status,param,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_image_parts_are_named(recorded, content, status, param, words):
    _, client, pipe = recorded
    before = len(pipe.requests)
    r = chat(client, [{"role": "user", "content": content}])
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert len(pipe.requests) == before  # nothing reached the engine


def test_image_parts_outside_user_messages_are_refused(recorded):
    _, client, _ = recorded
    r = chat(client, [{"role": "system", "content": [image_part(data_uri(A_PNG))]},
                      {"role": "user", "content": "x"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0]"
    assert "user messages only" in r.json()["error"]["message"]


def test_chat_body_past_its_limit_is_413(recorded):
    _, client, _ = recorded
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (6 * IMAGE_LIMIT)}]}).encode()
    r = client.post("/v1/chat/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "the limit is" in r.json()["error"]["message"], r.text


def test_a_model_that_does_not_edit_refuses_the_part(served):
    r = chat(served.client, [{"role": "user", "content": [_text("a fox"), image_part(data_uri(B_PNG))]}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]", r.text
    assert "model hunyuan_image3_tiny does not take reference images" in r.json()["error"]["message"]
    assert served.scheduler.queue_depth == 0


def test_recipe_fields_reach_the_serving_options():
    recipe = load_recipe("cpu_tiny").replace_paths({"serving.fetch_remote_images": True,
                                                    "serving.max_image_pixels": 4096})
    options = ServingOptions.from_recipe(recipe, model_id="x")
    assert options.fetch_remote_images and options.max_image_pixels == 4096
    default = ServingOptions.from_recipe(load_recipe("cpu_tiny"), model_id="x")
    assert not default.fetch_remote_images and default.max_image_pixels == 4096 * 4096


# ------------------------------------------------------------------ remote URLs (serving.fetch_remote_images: true)


def test_remote_image_is_fetched_when_allowed(fetching, image_host):
    client, pipe = fetching
    for path in ("/a.png", "/redirect"):
        r = chat(client, [{"role": "user", "content": [_text(), image_part(image_host + path)]}])
        assert r.status_code == 200, r.text
        assert np.array_equal(pipe.requests[-1].images[0], A_PIXELS)


@pytest.mark.parametrize("path,status,words", [("/missing", 400, "HTTP 404"), ("/big", 413, "bytes per image"),
                                               ("/slow", 400, "timed out after 0.5s")])
def test_remote_failures_are_named(fetching, image_host, path, status, words):
    client, _ = fetching
    r = chat(client, [{"role": "user", "content": [_text(), image_part(image_host + path)]}])
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "messages[0].content[1]" and words in r.json()["error"]["message"]


def test_unreachable_host_is_400(fetching):
    client, _ = fetching
    r = chat(client, [{"role": "user", "content": [_text(), image_part("http://127.0.0.1:9/none.png")]}])
    assert r.status_code == 400 and "failed" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------ the tiny Instruct model, end to end


def test_instruct_chat_edit_round_trip(instruct):
    url, options, scheduler = instruct
    pixels, blob = image_file(256, 256, seed=4)
    out = sdk(url).chat.completions.create(
        model=options.model_id, messages=[{"role": "user", "content": [_text("make it blue"),
                                                                       image_part(data_uri(blob))]}],
        extra_body={"modalities": ["image"], "seed": 2, "num_inference_steps": 2})
    png = base64.b64decode(out.choices[0].message.content[0]["image_url"]["url"].split(",", 1)[1])
    h, w = options.helpers.snap(256, 256)
    assert png_array(png).shape == (h, w, 3)
    assert not scheduler.has_work()
