"""``omni-run chat`` and ``--bot-task`` on generate / edit: real commands on the embedded tiny Instruct model.

The tiny model's random weights answer gibberish tokens: the tests check the
structure (streamed pieces, one line per answer, exit codes, the CoT on
stderr), with greedy sampling and a fixed seed so that two runs agree. The
hand-over tests replace ``omni.chat.chat_main`` / ``omni.generate.generate_main``
with recorders (no model runs) to check the job the flags become.
"""
from __future__ import annotations

import io
import logging
import sys

import numpy as np
import pytest
from PIL import Image

from omni.cli import main
from omni.models.hunyuan_image3.system_prompts import SYSTEM_PROMPTS

INSTRUCT = "cpu_tiny_instruct"
GREEDY = ["--recipe", INSTRUCT, "--max-tokens", "8", "--temperature", "0", "--seed", "1"]


class Recorder:
    """A stdout that keeps every write (to see the answer arrive in pieces)."""

    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    @property
    def text(self) -> str:
        return "".join(self.writes)


@pytest.fixture(scope="module")
def one_shot():
    """The writes of ``omni-run chat --prompt "a red cat"`` (greedy, 8 tokens), run once in this process."""
    out, saved = Recorder(), sys.stdout
    sys.stdout = out
    try:
        assert main(["chat", "--prompt", "a red cat", *GREEDY]) == 0
    finally:
        sys.stdout = saved
    return out


def test_chat_help_teaches(capsys):
    assert main(["chat", "--help"]) == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "omni-run chat --recipe cpu_tiny_instruct --prompt" in out
    assert "no history" in out and "one per line" in out and "exits 2" in out


def test_one_shot_writes_the_answer_then_a_newline(one_shot):
    answer = one_shot.text
    assert answer.endswith("\n") and answer.count("\n") == 1 and answer.strip()


def test_one_shot_streams_a_long_answer_in_pieces(monkeypatch):
    """Written as it is generated, not in one go at the end. The CLI polls every ``POLL_S`` (20 ms) and writes
    what was published since: the tiny model decodes 8 tokens in about one poll (so an 8-token answer may
    arrive whole), 128 in about a dozen."""
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["chat", "--prompt", "a red cat", *GREEDY, "--max-tokens", "128"]) == 0
    pieces = [w for w in out.writes if w.strip()]
    assert len(pieces) >= 2 and out.text.endswith("\n") and out.text.count("\n") == 1


def test_interactive_answers_each_stdin_line(one_shot, monkeypatch, caplog):
    out = Recorder()
    monkeypatch.setattr(sys, "stdin", io.StringIO("a red cat\n\nwhat is two plus two\n"))
    monkeypatch.setattr(sys, "stdout", out)
    with caplog.at_level(logging.INFO, logger="omni.chat"):
        assert main(["chat", *GREEDY]) == 0
    lines = out.text.split("\n")
    assert len(lines) == 3 and lines[2] == ""  # two answers (the empty line is skipped), each ending a line
    assert lines[0] + "\n" == one_shot.text  # a fresh single-turn prompt: the same answer as one-shot
    assert lines[1] and lines[1] != lines[0]
    assert caplog.text.count("8 tokens (length)") == 2


@pytest.mark.parametrize("argv,words", [
    (["chat", "--recipe", "cpu_tiny", "--prompt", "x"], "model hunyuan_image3_tiny does not write text"),
    (["chat", "--recipe", INSTRUCT, "--prompt", "x", "--max-tokens", "0"], "--max-tokens must be 1..4096"),
    (["chat", "--recipe", INSTRUCT, "--prompt", "x", "--temperature", "-1"], "--temperature must be"),
    (["chat", "--recipe", INSTRUCT, "--prompt", "x", "--top-p", "0"], "--top-p must be 1e-06..1"),
    (["chat", "--recipe", INSTRUCT, "--prompt", "x", "--image", "missing.png"], "--image missing.png"),
    (["generate", "--recipe", "cpu_tiny", "--prompt", "x", "--bot-task", "think"],
     "--bot-task think: model hunyuan_image3_tiny does not write text"),
    (["generate", "--recipe", INSTRUCT, "--prompt", "x", "--drop-think"], "--drop-think applies to"),
    (["generate", "--recipe", INSTRUCT, "--prompt", "x", "--cot-max-tokens", "8"], "--cot-max-tokens"),
])
def test_refusals_exit_2_with_the_reason(capsys, argv, words):
    assert main(argv) == 2
    assert words in capsys.readouterr().err


# ------------------------------------------------------------------ the jobs the flags become


@pytest.fixture
def handed(monkeypatch):
    import omni.chat
    import omni.generate

    calls = []
    monkeypatch.setattr(omni.chat, "chat_main", lambda deployment, job: calls.append(job) or 0)
    monkeypatch.setattr(omni.generate, "generate_main", lambda deployment, job: calls.append(job.request) or 0)
    return calls


def test_chat_flags_become_the_job(handed, tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    assert main(["chat", "--recipe", INSTRUCT, "--image", str(tmp_path / "a.png"), "--system-prompt", "en_vanilla",
                 "--top-p", "0.5", "--top-k", "7", "--seed", "3"]) == 0
    (job,) = handed
    assert job.prompt is None  # no --prompt: stdin
    assert job.system_prompt == SYSTEM_PROMPTS["en_vanilla"]  # a mode name is resolved to its text
    assert job.sampling == {"max_tokens": 256, "top_p": 0.5, "top_k": 7, "seed": 3}
    assert len(job.images) == 1 and np.array_equal(job.images[0], rgb)
    req = job.request("hi")
    assert (req.prompt, req.temperature, req.top_k, req.max_tokens) == ("hi", 0.6, 7, 256)


def test_bot_task_flags_reach_the_image_request(handed, tmp_path):
    rgb = np.zeros((256, 256, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "a.png")
    assert main(["edit", "--recipe", INSTRUCT, "--image", str(tmp_path / "a.png"), "--prompt", "x", "--bot-task",
                 "think", "--drop-think", "--size", "auto", "--cot-max-tokens", "9"]) == 0
    assert main(["generate", "--recipe", INSTRUCT, "--prompt", "x", "--size", "auto"]) == 0
    edit, plain = handed
    assert (edit.bot_task, edit.drop_think, edit.auto_size, edit.cot_max_tokens) == ("think", True, True, 9)
    assert (plain.bot_task, plain.auto_size, (plain.width, plain.height)) == ("image", False, (256, 256))


# ------------------------------------------------------------------ think, then draw


def test_generate_think_recaption_writes_a_png_and_prints_the_cot(tmp_path, capsys):
    out = tmp_path / "fox.png"
    assert main(["generate", "--recipe", INSTRUCT, "--prompt", "a red fox", "--bot-task", "think_recaption",
                 "--cot-max-tokens", "12", "--steps", "2", "--guidance", "1", "--size", "256x256", "--seed", "2",
                 "-o", str(out)]) == 0
    assert np.asarray(Image.open(out)).shape == (256, 256, 3)
    captured = capsys.readouterr()
    assert "revised prompt (think_recaption): <think>" in captured.err
    assert f"wrote {out}" in captured.out
