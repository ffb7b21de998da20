"""Text answers and think / recaption over a real localhost server, driven by the official openai client.

The tiny Instruct architecture (recipe ``cpu_tiny_instruct`` with flavour
``hunyuan_image3_instruct_tiny_random``: its answers are gibberish tokens) answers T2T and I2T chats, plain and streamed
(server-sent events), and draws after writing a CoT. The base tiny flavour's
helpers (over a model-free engine) show a model that does not write text
refusing both by name. Small settings throughout: 4-8 tokens, 2 steps, 256x256.
"""
from __future__ import annotations

import base64
import json

import pytest

from omni import model_registry
from omni.engine_loop import EngineLoop
from omni.request import TextRequest
from omni.scheduler import Scheduler
from omni.serving.app import ServingOptions, create_app
from omni.serving.text_stream import TextDeltas

from serving_harness import FAULT_IN_STEP, FakePipeline, ServerThread, png_array, raw_post, wait_until

import test_edits
from test_edits import image_file, sdk

openai = pytest.importorskip("openai")

instruct = test_edits.instruct  # the tiny Instruct server fixture (module scope: one per module)
USER = [{"role": "user", "content": "a red cat"}]  # greedy answers of this prompt run past 8 tokens


def ask(url: str, messages=USER, model: str = "hunyuan_image3_instruct_tiny", **kw):
    return sdk(url).chat.completions.create(model=model, messages=messages, modalities=["text"], **kw)


def streamed(url: str, messages=USER, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice, finish_reason per choice, every chunk) of a streamed answer."""
    texts, reasons, chunks = {}, {}, []
    for chunk in ask(url, messages, stream=True, **kw):
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def prompt_tokens(scheduler, prompt: str, images: tuple = ()) -> int:
    """How many tokens the model's own template makes of ``prompt`` (the usage the server must report)."""
    model = scheduler.pipeline.inner.model
    return len(model.text_row(TextRequest(prompt=prompt, images=images)).ids)


def data_uri(blob: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(blob).decode()}"


# ------------------------------------------------------------------ plain answers


def test_text_answer_content_usage_and_length(instruct):
    url, options, scheduler = instruct
    out = ask(url, max_tokens=8, temperature=0, seed=1)
    choice = out.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert out.object == "chat.completion" and out.model == options.model_id
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == prompt_tokens(scheduler, "a red cat")
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert ask(url, max_completion_tokens=8, temperature=0, seed=1).choices[0].message.content == \
        choice.message.content  # the same greedy answer under OpenAI's newer name for the limit
    assert not scheduler.has_work()


def test_a_stop_token_ends_the_answer(instruct):
    url, _, _ = instruct
    out = ask(url, messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0)
    # the tiny model's greedy first token for this prompt is its stop token: an empty answer that stopped
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == ("", "stop")
    assert out.usage.completion_tokens == 1  # the stop token was generated, so it counts


def test_system_messages_are_the_system_prompt(instruct):
    url, options, scheduler = instruct
    plain = ask(url, max_tokens=4, temperature=0)
    with_system = ask(url, messages=[{"role": "system", "content": "answer briefly"}, *USER], max_tokens=4,
                      temperature=0)
    assert with_system.usage.prompt_tokens > plain.usage.prompt_tokens


def test_image_url_parts_are_the_images_of_an_i2t_answer(instruct):
    url, options, scheduler = instruct
    pixels, blob = image_file(256, 256, seed=3)
    messages = [{"role": "user", "content": [{"type": "text", "text": "a red cat"},
                                             {"type": "image_url", "image_url": {"url": data_uri(blob)}}]}]
    out = ask(url, messages=messages, max_tokens=6, temperature=0)
    assert isinstance(out.choices[0].message.content, str)
    assert out.usage.prompt_tokens == prompt_tokens(scheduler, "a red cat", (pixels,))
    assert out.usage.prompt_tokens > ask(url, max_tokens=6, temperature=0).usage.prompt_tokens


def test_n_answers_use_seed_plus_i(instruct):
    url, _, _ = instruct
    out = ask(url, n=2, max_tokens=6, seed=5)
    assert [c.index for c in out.choices] == [0, 1] and [c.seed for c in out.choices] == [5, 6]
    if all(c.finish_reason == "length" for c in out.choices):
        assert out.usage.completion_tokens == 12  # both answers' tokens; the prompt counted once
    alone = ask(url, max_tokens=6, seed=6)
    assert alone.choices[0].message.content == out.choices[1].message.content
    texts, reasons, _ = streamed(url, n=2, max_tokens=6, seed=5)
    assert texts == {0: out.choices[0].message.content, 1: out.choices[1].message.content}
    assert reasons == {0: "length", 1: "length"}


# ------------------------------------------------------------------ streaming


def test_a_long_answer_arrives_in_pieces(instruct):
    """Streamed as it is generated, not in one go: the stream looks at its ticket every ``POLL_S`` (10 ms); the
    tiny model decodes 8 tokens in about two looks (so a short answer may come whole), 128 in a couple of dozen."""
    url, _, scheduler = instruct
    texts, reasons, chunks = streamed(url, max_tokens=128, temperature=0.0, seed=2)
    contents = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(contents) >= 2 and "".join(c.choices[0].delta.content for c in contents) == texts[0]
    assert reasons == {0: "length"} and not scheduler.has_work()


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_stream_deltas_add_up_to_the_answer(instruct, temperature):
    url, _, scheduler = instruct
    plain = ask(url, max_tokens=8, temperature=temperature, seed=2)
    texts, reasons, chunks = streamed(url, max_tokens=8, temperature=temperature, seed=2,
                                      stream_options={"include_usage": True})
    assert texts == {0: plain.choices[0].message.content} and reasons == {0: "length"}
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert not scheduler.has_work()


def test_deltas_are_append_only():
    d = TextDeltas()
    assert [d.push("a"), d.push("a b"), d.push("a b\ufffd")] == ["a", " b", ""]  # an incomplete character waits
    assert d.push("a b\u00e9") == "\u00e9"  # ... until the next token completes it
    assert d.push("a X") == "" and d.push("a b\u00e9 c") == " c"  # a revised tail sends nothing until text extends
    assert d.finish("a b\u00e9 c d") == " d" and not d.diverged
    e = TextDeltas()
    e.push("a b")
    assert e.finish("a X") == "" and e.diverged  # never re-sent: the caller logs it


def test_a_failure_mid_stream_is_an_error_event(instruct):
    url, _, scheduler = instruct
    failed = scheduler.stats["failed"]
    with pytest.raises(openai.APIError, match="internal error") as e:
        streamed(url, messages=[{"role": "user", "content": f"a red cat {FAULT_IN_STEP}"}], max_tokens=8)
    assert not isinstance(e.value, openai.APIStatusError)  # the stream had begun: 200, then the error event
    assert scheduler.stats["failed"] == failed + 1
    assert scheduler.pool.free_pages == scheduler.pool.num_pages


def test_stream_without_usage_has_no_usage_chunk(instruct):
    url, _, _ = instruct
    _, _, chunks = streamed(url, max_tokens=4, temperature=0)
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_a_client_leaving_mid_stream_frees_its_pages(instruct):
    url, _, scheduler = instruct
    pool = scheduler.pool
    assert pool.free_pages == pool.num_pages
    cancelled = scheduler.stats["cancelled"]
    body = {"messages": USER, "modalities": ["text"], "stream": True, "max_tokens": 4000, "temperature": 0}
    sock = raw_post(int(url.rsplit(":", 1)[1]), "/v1/chat/completions", json.dumps(body).encode())
    seen = b""
    while seen.count(b"data: ") < 3:  # the role chunk and two pieces of text: the answer is being generated
        seen += sock.recv(65536)
    assert b" 200 OK" in seen.split(b"\r\n", 1)[0] and b"text/event-stream" in seen
    assert pool.free_pages < pool.num_pages
    sock.close()  # 4000 tokens would take the tiny model ~20 s: only a cancellation frees the pages this soon
    wait_until(lambda: pool.free_pages == pool.num_pages, 5, "pages still held after the client left")
    assert scheduler.stats["cancelled"] == cancelled + 1 and not scheduler.has_work()


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kw,field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": 1e-300}, "temperature"),  # it would overflow the logits it divides: refused up front
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 1e-300}, "top_p"),  # 0 in float32: no token would be kept
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_completion_tokens": 9999}, "max_completion_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
    ({"stop": ["\n"]}, "stop"),
    ({"stop": "cat"}, "stop"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"logprobs": True}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"size": "256x256"}}, "size"),
    ({"extra_body": {"num_inference_steps": 2}}, "num_inference_steps"),
    ({"extra_body": {"bot_task": "think"}}, "bot_task"),
    ({"messages": [*USER, {"role": "assistant", "content": "a cat"}, *USER]}, "messages[1]"),
])
def test_bad_text_parameters_name_the_field(instruct, kw, field):
    url, _, scheduler = instruct
    with pytest.raises(openai.BadRequestError) as e:
        ask(url, **kw)
    assert e.value.body["param"] == field, e.value.body
    assert not scheduler.has_work()


def test_too_many_modalities_name_the_field(instruct):
    url, _, _ = instruct
    with pytest.raises(openai.BadRequestError) as e:
        sdk(url).chat.completions.create(model=None, messages=USER, modalities=["text", "audio"])
    assert e.value.body["param"] == "modalities"


def test_image_chat_still_accepts_and_ignores_text_knobs(instruct):
    url, options, _ = instruct
    for modalities in (None, ["image"]):  # absent is an image, as vLLM-Omni image clients expect
        extra = {"modalities": modalities} if modalities else {}
        out = sdk(url).chat.completions.create(
            model=options.model_id, messages=USER, temperature=0.3, top_p=0.5, max_tokens=3,
            extra_body={"seed": 1, "num_inference_steps": 2, "size": "256x256", **extra})
        assert out.choices[0].message.content[0]["type"] == "image_url"
    with pytest.raises(openai.BadRequestError, match="streaming is not supported for image") as e:
        sdk(url).chat.completions.create(model=options.model_id, messages=USER, stream=True).close()
    assert e.value.body["param"] == "stream"


# ------------------------------------------------------------------ a model that does not write text


@pytest.fixture(scope="module")
def base():
    """The base tiny flavour's own helpers (writes_text False) over a model-free engine: refusals come first."""
    engine = EngineLoop.around(Scheduler(FakePipeline(num_pages=256), max_running=2)).start()
    assert engine.wait_ready(10)
    helpers = model_registry.get("hunyuan_image3_tiny").serving_helpers()
    with ServerThread(create_app(engine, ServingOptions(model_id="hunyuan_image3_tiny", helpers=helpers))) as srv:
        yield srv.url
    engine.stop()


def test_a_base_model_refuses_text_naming_its_flavour(base):
    with pytest.raises(openai.BadRequestError, match="hunyuan_image3_tiny does not write text") as e:
        ask(base, model="hunyuan_image3_tiny", max_tokens=4)
    assert e.value.body["param"] == "modalities"
    with pytest.raises(openai.BadRequestError, match="hunyuan_image3_tiny") as e:
        sdk(base).images.generate(prompt="x", extra_body={"bot_task": "think_recaption"})
    assert e.value.body["param"] == "bot_task"


# ------------------------------------------------------------------ think / recaption before drawing


def test_think_recaption_produces_an_image_end_to_end_on_the_embedded_default(instruct):
    url, options, scheduler = instruct
    scheduler.pipeline.real_decode = True  # the real VAE: an image, not the harness's latents dump
    try:
        out = sdk(url).images.generate(prompt="a red cat", size="256x256", extra_body={
            "bot_task": "think_recaption", "cot_max_tokens": 12, "seed": 3, "num_inference_steps": 2})
    finally:
        scheduler.pipeline.real_decode = False
    cot = out.data[0].revised_prompt
    assert isinstance(cot, str) and cot.startswith("<think>") and len(cot) > len("<think>")
    pixels = png_array(base64.b64decode(out.data[0].b64_json))
    assert pixels.shape == (256, 256, 3) and pixels.std() > 1
    assert scheduler.pool.free_pages == scheduler.pool.num_pages


def test_bot_task_fields_and_auto_size(instruct):
    url, options, _ = instruct
    common = {"cot_max_tokens": 8, "seed": 3, "num_inference_steps": 2}
    plain = sdk(url).images.generate(prompt="a red cat", size="256x256",
                                     extra_body={"seed": 3, "num_inference_steps": 2})
    assert plain.data[0].revised_prompt is None
    recap = sdk(url).images.generate(prompt="a red cat", size="256x256",
                                     extra_body={"bot_task": "recaption", **common})
    assert recap.data[0].revised_prompt.startswith("<recaption>")
    auto = sdk(url).images.generate(prompt="a red cat", size="auto",
                                    extra_body={"bot_task": "think", "drop_think": True, **common})
    w, h = map(int, auto.size.split("x"))  # the model chose the ratio: one of its table's sizes
    assert options.helpers.snap(h, w) == (h, w) and auto.data[0].revised_prompt.startswith("<think>")
    chat = sdk(url).chat.completions.create(model=options.model_id, messages=USER, extra_body={
        "modalities": ["image"], "bot_task": "think_recaption", "size": "256x256", **common})
    text, image = chat.choices[0].message.content
    assert text["type"] == "text" and text["text"].startswith("<think>") and image["type"] == "image_url"
    for extra, field in (({"bot_task": "dance"}, "bot_task"), ({"drop_think": True}, "drop_think"),
                         ({"bot_task": "recaption", "drop_think": True}, "drop_think"),
                         ({"cot_max_tokens": 8}, "cot_max_tokens"), ({"bot_task": "think", "cot_max_tokens": 0},
                                                                     "cot_max_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            sdk(url).images.generate(prompt="x", extra_body=extra)
        assert e.value.body["param"] == field
