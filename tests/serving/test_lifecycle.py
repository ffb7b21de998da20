"""Server lifecycle and access over HTTP, on a model-free pipeline: health while loading and after
death, the API key, timeouts, and the 127.0.0.1 default."""
from __future__ import annotations

import threading

import httpx
import pytest

from omni.engine_loop import EngineLoop
from omni.scheduler import Scheduler
from omni.serving.app import ServingOptions, create_app

from serving_harness import FakePipeline, ServerThread, wait_until


def options(**kw) -> ServingOptions:
    return ServingOptions(model_id="fake", **kw)


def test_health_is_503_until_ready_then_200():
    gate = threading.Event()
    pipe = FakePipeline(num_pages=2048)

    def build():
        gate.wait(10)
        return Scheduler(pipe, max_running=2)

    engine = EngineLoop(build).start()
    with ServerThread(create_app(engine, options())) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "starting" and r.headers["retry-after"]
        r = c.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        gate.set()
        assert engine.wait_ready(10)
        assert c.get("/health").status_code == 200
        r = c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 2})
        assert r.status_code == 200, r.text
    engine.stop()


def test_health_is_503_when_the_engine_died():
    def build():
        raise RuntimeError("recipe asks for paged KV; the attention backend cannot serve it")

    engine = EngineLoop(build).start()
    engine.wait_ready(10)
    with ServerThread(create_app(engine, options())) as srv, httpx.Client(base_url=srv.url) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "dead" and "paged KV" in r.json()["reason"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503


@pytest.fixture
def fake_server():
    pipe = FakePipeline(num_pages=2048, step_delay_s=0.02)
    engine = EngineLoop.around(Scheduler(pipe, max_running=4)).start()
    engine.wait_ready(10)
    servers = []

    def start(**kw):
        srv = ServerThread(create_app(engine, options(**kw))).__enter__()
        servers.append(srv)
        return srv, pipe

    yield start
    for srv in servers:
        srv.__exit__(None, None, None)
    engine.stop()


def test_api_key_guards_v1_only(fake_server):
    srv, _ = fake_server(api_key="s3cret")
    with httpx.Client(base_url=srv.url) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_timeout_cancels_and_frees_pages(fake_server):
    srv, pipe = fake_server(request_timeout_s=0.3)
    with httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 200})
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
    wait_until(lambda: pipe.pool.free_pages == pipe.pool.num_pages, 10, "pages not freed after the timeout")


def test_request_id_is_echoed_and_used(fake_server):
    srv, _ = fake_server()
    with httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/images/generations", json={"prompt": "", "n": 1}, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["error"]["request_id"] == "abc-123" and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[1]"),  # this model does not edit: the image part is named
    ({"messages": [{"role": "user", "content": "x"}], "height": 100, "width": 100}, "height/width"),
    ({"messages": [{"role": "user", "content": "x"}], "extra_body": {"num_inference_steps": -1}},
     "num_inference_steps"),
])
def test_chat_bad_input_names_the_field(fake_server, body, field):
    srv, _ = fake_server()
    with httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_binds_localhost_by_default():
    from omni.recipe import load_recipe

    assert load_recipe("cpu_tiny").serving.host == "127.0.0.1"
