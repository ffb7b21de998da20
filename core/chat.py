"""``omni-run chat``: text answers through the deployment's engine handle, streamed to stdout as they grow.

One ``--prompt`` is one answer; without it every line of stdin is one
(a terminal gets a ``> `` prompt on stderr). Each line is a fresh
single-turn prompt with the same images and sampling flags: the model never
sees earlier lines or answers. The answer is written as the engine publishes
it (``Ticket.updates``, cut into append-only pieces by
``omni.serving.text_stream``), then a newline; a summary line goes to the log
(stderr). Tickets of multi-process replicas have no updates: their answer is
written whole when it is done.

World size 1 runs the engine loop in this process; a multi-rank recipe
launches one replica's ranks, as ``generate`` does. Where the recipe sets
``serving.compile_first`` the engine first runs the first prompt's request
(``describe this`` for stdin's, with the same images), cut to a few tokens,
through the platform's compile pass (``compile_ahead_request``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import sys
import time
from dataclasses import dataclass, field

from .deployment import Deployment, one_replica
from .engine_handle import compile_ahead_request
from .request import TextRequest
from .serving.text_stream import TextDeltas, latest_update

log = logging.getLogger("omni.chat")
POLL_S = 0.02
FIRST_PROMPT = "describe this"  # what the compile pass answers when the prompts come from stdin


@dataclass(frozen=True)
class ChatJob:
    """What to answer and how (the CLI's flags, checked): ``prompt`` None reads prompts from stdin."""

    prompt: str | None
    images: tuple = field(default=(), compare=False)  # uint8 [H, W, 3] RGB arrays (checked by image_input)
    system_prompt: str | None = None  # the text (a mode name is resolved by the CLI)
    sampling: dict = field(default_factory=dict)  # max_tokens / temperature / top_p / top_k / seed, as given

    def request(self, prompt: str) -> TextRequest:
        return TextRequest(prompt=prompt, images=self.images, system_prompt=self.system_prompt, **self.sampling)


def chat_main(deployment: Deployment, job: ChatJob, stdin=None, stdout=None) -> int:
    """Answer ``job`` (one prompt, or each line of ``stdin``) on ``stdout``; 0 when every answer was written."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    first = job.request(job.prompt if job.prompt is not None else FIRST_PROMPT)
    engine = one_replica(deployment).open_engine(compile_ahead=(compile_ahead_request(deployment, first),))
    try:
        engine.start()
        if not engine.wait_ready():  # the build's own error (a refusal stays a configuration error: exit 2)
            raise engine.error or RuntimeError(engine.unavailable_reason())
        prompts = [job.prompt] if job.prompt is not None else _lines(stdin)
        for prompt in prompts:
            answer(engine, job.request(prompt), stdout)
    finally:
        engine.stop()
    return 0


def _lines(stdin):
    """The non-empty lines of ``stdin``, with a ``> `` prompt on stderr at a terminal."""
    tty = stdin.isatty()
    if tty:
        print("one prompt per line, each answered on its own (no history); Ctrl-D to quit", file=sys.stderr)
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def answer(engine, req: TextRequest, out) -> None:
    """Submit ``req`` and write its answer to ``out`` as it grows, then a newline; cancelled on Ctrl-C."""
    t0 = time.perf_counter()
    [ticket] = engine.submit_many([req])
    deltas = TextDeltas()
    try:
        while True:
            done = ticket.future.done()  # looked at first: no update published before it is missed
            text = latest_update(ticket)
            if text is not None:
                _write(out, deltas.push(text))
            if done:
                break
            concurrent.futures.wait([ticket.future], timeout=POLL_S)
        result = ticket.result()
    except BaseException:
        engine.cancel(ticket)
        raise
    _write(out, deltas.finish(result.text) + "\n")
    if deltas.diverged:
        log.warning("the detokenizer revised text already written; the printed answer differs from the final one")
    log.info("%d tokens (%s), prompt %d tokens, seed %d, %.2fs", len(result.token_ids), result.finish_reason,
             result.prompt_tokens, result.seed, time.perf_counter() - t0)


def _write(out, text: str) -> None:
    if text:
        out.write(text)
        out.flush()
