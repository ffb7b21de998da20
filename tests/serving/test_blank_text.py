"""One meaning of blank text: the server's (``validation.is_blank``) and the OpenAPI document's (``NON_BLANK``).

JSON Schema patterns are ECMA-262 regexes, whose ``\\s`` is WhiteSpace and LineTerminator (\\t \\n \\v \\f \\r space
\\xa0 \\ufeff \\u2028 \\u2029 and category Zs); Python's ``str.isspace`` and ``re``'s ``\\s`` (jsonschema's,
schemathesis' generator) also take \\x1c-\\x1f and \\x85 and not \\ufeff. Blank is the union, under every engine.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import unicodedata

import httpx
import jsonschema
import pytest

from omni.engine_loop import EngineLoop
from omni.scheduler import Scheduler
from omni.serving.app import ServingOptions, create_app
from omni.serving.openapi import NON_BLANK
from omni.serving.validation import is_blank

from serving_harness import FakePipeline, ServerThread

SPEC_SPACE = "\t\n\v\f\r \xa0\ufeff\u2028\u2029"  # ECMA-262 WhiteSpace and LineTerminator, besides category Zs
BMP = [chr(c) for c in range(0x10000) if not 0xD800 <= c < 0xE000]
ECMA_SPACE = {c for c in BMP if c in SPEC_SPACE or unicodedata.category(c) == "Zs"}
PY_SPACE = {c for c in BMP if c.isspace()}
SERVER_BLANK = {c for c in BMP if is_blank(c)}


def listed() -> set[str]:
    """The characters NON_BLANK's class names besides ``\\s`` (hex escapes and ranges: the same in both engines)."""
    shape = re.fullmatch(r"\^\[\\s\\S\]\*\[\^\\s([^\]\\]*(?:\\[xu][0-9a-fA-F]+[^\]\\]*)*)\]\[\\s\\S\]\*\$", NON_BLANK)
    assert shape, NON_BLANK  # ^[\s\S]*[^\s...][\s\S]*$, anchored (openapi.py says why)
    names = re.compile(f"[{shape[1]}]")
    return {c for c in BMP if names.fullmatch(c)}


def test_python_and_ecma_whitespace_differ_only_where_the_pattern_names():
    """The class excludes \\s plus its listed characters: the union under either engine, and the server's blank."""
    assert PY_SPACE - ECMA_SPACE <= set("\x1c\x1d\x1e\x1f\x85"), sorted(map(hex, map(ord, PY_SPACE - ECMA_SPACE)))
    assert ECMA_SPACE - PY_SPACE <= {"\ufeff"}, sorted(map(hex, map(ord, ECMA_SPACE - PY_SPACE)))
    union = PY_SPACE | ECMA_SPACE
    assert listed() <= union  # it names only whitespace
    assert PY_SPACE | listed() == ECMA_SPACE | listed() == union == SERVER_BLANK


def test_the_pattern_under_python_re_is_the_servers_rule():
    """Every BMP character, then longer texts; with jsonschema (Python re) as well."""
    pattern = re.compile(NON_BLANK)
    assert [hex(ord(c)) for c in BMP if bool(pattern.fullmatch(c)) == is_blank(c)] == []
    schema = jsonschema.Draft202012Validator({"type": "string", "pattern": NON_BLANK})
    for text, blank in (("", True), (" \x85 ", True), ("\ufeff\x1c\u3000\n", True), ("a\x1c", False),
                        ("\ufeffx\ufeff", False), (" a b ", False), ("x\ny", False), ("\u00a0z", False)):
        assert is_blank(text) == blank and schema.is_valid(text) != blank and bool(pattern.search(text)) != blank, \
            repr(text)


NODE_CHECK = """
const [pattern, flags] = JSON.parse(process.argv[1]);
const re = new RegExp(pattern, flags), out = [];
for (let c = 0; c < 0x10000; c++) {
  if (c >= 0xd800 && c < 0xe000) continue;
  if (!re.test(String.fromCharCode(c))) out.push(c);
}
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node (an ECMA-262 engine) is not installed")
@pytest.mark.parametrize("flags", ["", "u"])
def test_the_pattern_under_ecma_is_the_servers_rule(flags):
    """An ECMA-262 engine itself (node's), as a JS client's validator runs the pattern, with and without ``u``."""
    out = subprocess.run(["node", "-e", NODE_CHECK, json.dumps([NON_BLANK, flags])], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert {chr(c) for c in json.loads(out)} == SERVER_BLANK


@pytest.fixture(scope="module")
def server():
    engine = EngineLoop.around(Scheduler(FakePipeline(num_pages=2048), max_running=4)).start()
    engine.wait_ready(10)
    with ServerThread(create_app(engine, ServingOptions(model_id="fake"))) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client
    engine.stop()


BLANKS = ["\x1c", "\ufeff", " \x85 ", "\ufeff \x1f\u2028"]


@pytest.mark.parametrize("text", BLANKS + ["a\x1c", "\ufeffa", "\x85a "])
def test_the_server_refuses_what_its_document_calls_blank(server, text):
    """Blank prompts, negative and system prompts, chat user texts: a 400 naming the field; the others are taken
    (the model gets the prompt as sent), as the served document's schemas say, by Python and ECMA regexes."""
    doc = server.get("/openapi.json").json()

    def schema(path: str) -> dict:  # the body's schema, its #/components/... references resolvable
        return {**doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"],
                "components": doc["components"]}

    generation, chat = schema("/v1/images/generations"), schema("/v1/chat/completions")
    blank = text in BLANKS
    cases = [("/v1/images/generations", generation, {"prompt": text}, "prompt"),
             ("/v1/images/generations", generation, {"prompt": "x", "negative_prompt": text}, "negative_prompt"),
             ("/v1/images/generations", generation, {"prompt": "x", "system_prompt": text}, "system_prompt"),
             ("/v1/chat/completions", chat, {"messages": [{"role": "user", "content": text}]}, "messages"),
             ("/v1/chat/completions", chat,
              {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}, "messages")]
    for path, body_schema, body, field in cases:
        body = {**body, "num_inference_steps": 1, "size": "64x64"}
        r = server.post(path, json=body)
        if blank:
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        else:
            assert r.status_code == 200, (field, r.text)
        for name, valid in validators(body_schema):
            assert valid(body) != blank, (name, field, body)


def validators(schema: dict) -> list:
    """(name, is_valid) of jsonschema (Python re) and, where installed, jsonschema_rs (an ECMA-262 regex engine,
    the one schemathesis judges data with)."""
    out = [("jsonschema", jsonschema.Draft202012Validator(schema).is_valid)]
    try:
        import jsonschema_rs
    except ImportError:
        return out
    return out + [("jsonschema_rs", jsonschema_rs.validator_for(schema).is_valid)]


@pytest.mark.parametrize("role", ["system", "developer"])
@pytest.mark.parametrize("content", ["", "  ", "\ufeff", [{"type": "text", "text": "\x1c"}]], ids=repr)
def test_a_blank_system_message_is_taken_as_absent(server, role, content):
    """The document lets a system or developer message's text be any string; a blank one says nothing, so the
    chat is answered as without it (it was a 400 naming system_prompt)."""
    doc = server.get("/openapi.json").json()
    chat = {**doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"],
            "components": doc["components"]}
    body = {"messages": [{"role": role, "content": content}, {"role": "user", "content": "a red circle"}],
            "num_inference_steps": 1, "size": "64x64"}
    assert all(valid(body) for _, valid in validators(chat))
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
