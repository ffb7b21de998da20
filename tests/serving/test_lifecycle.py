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


def test_api_key_guards_all_but_health(fake_server):
    srv, _ = fake_server(api_key="s3cret")
    with httpx.Client(base_url=srv.url) as c:
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 401


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
    ({"messages": [{"role": "user", "content": "x"}], "height": 50, "width": 50}, "height/width"),
    ({"messages": [{"role": "user", "content": "x"}], "extra_body": {"num_inference_steps": -1}},
     "num_inference_steps"),
])
def test_chat_bad_input_names_the_field(fake_server, body, field):
    srv, _ = fake_server()
    with httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("counts,field", [({"n": 3, "num_outputs_per_prompt": 1}, "n"),
                                          ({"n": 1, "num_outputs_per_prompt": 3}, "num_outputs_per_prompt")])
def test_chat_holds_each_count_field_to_the_queue(fake_server, counts, field):
    """The OpenAPI document caps both n and num_outputs_per_prompt by the queue; the second wins where both are
    given, yet an n past the cap is refused too (a fuzzer found it accepted)."""
    srv, _ = fake_server(max_queue=2)
    with httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **counts})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 2,
                                                  "num_outputs_per_prompt": 1, "num_inference_steps": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["message"]["content"]) == 1, ok.text


def test_binds_localhost_by_default():
    from omni.recipe import load_recipe

    assert load_recipe("cpu_tiny").serving.host == "127.0.0.1"


def test_metrics_need_the_key_when_one_is_set(fake_server):
    srv, _ = fake_server(api_key="s3cret")
    with httpx.Client(base_url=srv.url) as c:
        refused = c.get("/metrics")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        allowed = c.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert allowed.status_code == 200 and allowed.headers["content-type"].startswith("text/plain")
        assert "omni_queue_depth" in allowed.text


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v2/nothing", 404, "not_found"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
    ("GET", "/v1/images/generations", 405, "method_not_allowed"),
])
def test_routing_errors_have_the_openai_shape(fake_server, method, path, status, code):
    srv, _ = fake_server()
    r = httpx.request(method, srv.url + path)
    assert r.status_code == status and set(r.json()) == {"error"}, r.text
    err = r.json()["error"]
    assert err["code"] == code and path in err["message"] and {"message", "type", "param", "code"} <= set(err)


def test_openapi_documents_bodies_statuses_and_metrics_and_docs_are_served(fake_server):
    srv, _ = fake_server(api_key="s3cret")
    doc = httpx.get(srv.url + "/openapi.json").json()
    for path in ("/v1/images/generations", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert "prompt" in schema["properties"] or "messages" in schema["properties"]
        assert {"200", "400", "401", "404", "413", "415", "429", "503"} <= set(op["responses"])
        assert op["responses"]["429"]["headers"]["Retry-After"] and op["security"] == [{"bearer": []}]
    assert "/v1/images/edits" not in doc["paths"]  # FakePipeline's options edit nothing: not offered
    metrics = doc["paths"]["/metrics"]["get"]["responses"]
    assert list(metrics["200"]["content"]) == ["text/plain"] and "401" in metrics
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    docs = httpx.get(srv.url + "/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_openapi_size_pattern_is_the_servers_side_range():
    import re

    from omni.serving.openapi import int_range_regex, size_pattern

    side = re.compile("^(" + "|".join(int_range_regex(64, 4096)) + ")$")
    assert [n for n in range(0, 5000) if side.match(str(n))] == list(range(64, 4097))
    size = re.compile(size_pattern(512))
    assert size.match("512x64") and size.match("native") and size.match("300X200")
    assert not any(size.match(s) for s in ("513x64", "64x63", "0300x300", " 300x300", "300x300 "))


def test_openapi_non_blank_pattern_is_anchored_and_takes_spaces():
    """Texts need one non-space character. The pattern says so anchored: schemathesis folds minLength / maxLength
    into an unanchored r"\\S" as ^\\S{1,8000}$ (no space at all) and judged a form's "a b" invalid."""
    import re

    from omni.serving.openapi import NON_BLANK

    text = re.compile(NON_BLANK)
    assert NON_BLANK.startswith("^") and NON_BLANK.endswith("$")
    assert all(text.search(t) for t in ("a", " a b ", "x\ny", "\u00a0z")) and not any(
        text.search(t) for t in ("", "   ", "\n\t"))


@pytest.mark.parametrize("body,content_type,status,param,words", [
    (b'{"prompt": "a \\ud800 b"}', "application/json", 400, "prompt", "not valid Unicode"),
    (b'{"prompt": "x", "negative_prompt": "\\udfff"}', "application/json", 400, "negative_prompt", "Unicode"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "application/json", 400, "messages[0].content",
     "Unicode"),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400, None, "nested 100000 levels deep"),
    (b'{"prompt": "x", "n": "2"}', "application/json", 400, "n", "valid integer"),
    (b'{"prompt": "x", "n": true}', "application/json", 400, "n", "valid integer"),
    (b'{"prompt": "x", "stream": 0.0}', "application/json", 400, "stream", "valid boolean"),
    (b'{"prompt": "x", "seed": 9223372036854775800, "n": 2}', "application/json", 400, "seed", "less than"),
    (b'{"prompt": "x"}', "text/plain", 415, None, "application/json"),
    (b'{"prompt": "x", "size": "1024 x 1024"}', "application/json", 400, "size", "WIDTHxHEIGHT"),
])
def test_bad_inputs_of_the_issue_get_their_4xx(fake_server, body, content_type, status, param, words):
    srv, pipe = fake_server()
    path = "/v1/chat/completions" if b"messages" in body else "/v1/images/generations"
    r = httpx.post(srv.url + path, content=body, headers={"content-type": content_type})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert pipe.prefills == []  # nothing reached the engine


def test_an_integral_float_is_an_integer_as_json_says(fake_server):
    srv, _ = fake_server()
    r = httpx.post(srv.url + "/v1/images/generations", json={"prompt": "x", "n": 1.0, "num_inference_steps": 1,
                                                             "size": "256x256"})
    assert r.status_code == 200 and r.json()["size"] == "256x256", r.text


def test_after_the_stop_signal_calls_answer_503_with_retry_after(fake_server):
    """What a shutting-down server answers (the signal itself: test_cli_serve.py, with a real process)."""
    srv, _ = fake_server()
    srv.server.config.app.state.api.begin_shutdown()
    r = httpx.post(srv.url + "/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.json()["error"]["code"] == "shutting_down"
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "stopping"
