"""Shared pieces of the serving tests: a real uvicorn server in a thread, a test pipeline wrapper.

``TestPipeline`` wraps the real tiny pipeline. Its transformer, KV pool,
admission and packing are the real ones; two things differ:

- ``decode`` writes the final latents' raw float32 bytes into the image
  (unless ``real_decode`` is set). The tiny VAE needs 10-30 s per 1024px
  image on a 2-core CPU, and the image is a deterministic per-request
  function of the latents, so "same PNG bytes" here means "bitwise-equal
  latents", a stricter check than pixels after the VAE.
- a prompt containing ``FAULT_IN_STEP`` (or ``FAULT_IN_DECODE``) raises
  inside the pipeline, to test failure isolation.

``intraop_threads`` (when set) is applied on the engine thread before each
forward: OpenMP thread counts are per calling thread, so setting them from
the test thread does not reach a running engine.
"""
from __future__ import annotations

import contextlib
import io
import socket
import threading
import time

import numpy as np
import torch
import uvicorn
from PIL import Image

FAULT_IN_STEP, FAULT_IN_DECODE = "FAULT_IN_STEP", "FAULT_IN_DECODE"


class InjectedFault(RuntimeError):
    pass


class TestPipeline:
    __test__ = False  # not a pytest class

    def __init__(self, pipeline):
        self.inner = pipeline
        self.real_decode = False
        self.intraop_threads: int | None = None
        self.step_calls: list[int] = []  # batch size of every denoise_step call

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _threads(self) -> None:
        if self.intraop_threads is not None and torch.get_num_threads() != self.intraop_threads:
            torch.set_num_threads(self.intraop_threads)

    def prefill(self, states):
        self._threads()
        return self.inner.prefill(states)

    def denoise_step(self, states):
        self._threads()
        self.step_calls.append(len(states))
        if any(FAULT_IN_STEP in s.request.prompt for s in states):
            raise InjectedFault("injected fault in denoise_step")
        return self.inner.denoise_step(states)

    def decode(self, state):
        self._threads()
        if FAULT_IN_DECODE in state.request.prompt:
            raise InjectedFault("injected fault in decode")
        if self.real_decode:
            return self.inner.decode(state)
        return latents_as_image(state.latents_1Chw, state.request.height, state.request.width)


def latents_as_image(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 ``[H, W, 3]`` whose first bytes are the latents' float32 bytes (lossless), the rest zero."""
    raw = torch.frombuffer(bytearray(latents.detach().float().cpu().contiguous().numpy().tobytes()),
                           dtype=torch.uint8)
    out = torch.zeros(height * width * 3, dtype=torch.uint8)
    out[: raw.numel()] = raw
    return out.view(height, width, 3)


def png_array(blob: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn did not start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextlib.contextmanager
def recipe_client(recipe_name: str, model_id: str):
    """The official ``openai`` client on a real server over the real engine of recipe ``recipe_name``
    (built here on the CPU platform, stopped on exit), serving ``model_id``."""
    import openai

    from omni.engine_loop import EngineLoop
    from omni.models.hunyuan_image3.build import build_pipeline
    from omni.platform_manager import select
    from omni.recipe import load_recipe
    from omni.scheduler import Scheduler
    from omni.serving.app import ServingOptions, create_app

    recipe = load_recipe(recipe_name)
    engine = EngineLoop.around(Scheduler.from_recipe(build_pipeline(recipe, select("cpu"), progress=False),
                                                     recipe)).start()
    try:
        assert engine.wait_ready(30)
        with ServerThread(create_app(engine, ServingOptions.from_recipe(recipe, model_id=model_id))) as srv:
            yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        engine.stop()


def free_port() -> int:
    """A port free on 127.0.0.1 now (for servers started in another process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, timeout_s: float, message: str, poll_s: float = 0.25) -> None:
    """Poll ``url``/health until it answers 200; fail with the process's output if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, message
        time.sleep(poll_s)


def wait_until(predicate, timeout_s: float, message: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} (after {timeout_s}s)")
        time.sleep(poll_s)


def raw_post(port: int, path: str, body: bytes) -> socket.socket:
    """Send a POST and return the open socket (the caller closes it to simulate a client going away)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s.sendall(head + body)
    return s


class FakeState:
    def __init__(self, request, pages: list[list[int]], seed: int):
        from omni.request import StageTimes

        self.request, self.rows, self.seed = request, pages, seed
        self.step, self.value, self.times = 0, 0.0, StageTimes()

    @property
    def done(self) -> bool:
        return self.step >= self.request.steps


class FakePipeline:
    """The scheduler's pipeline protocol without a model: one token per 16x16 pixels, 8 prompt tokens.

    ``denoise_step`` advances the states in order and raises at the first
    whose prompt contains ``FAULT_IN_STEP`` (so earlier ones were already
    advanced: the scheduler must restore them). ``step_delay_s`` slows steps.
    """

    def __init__(self, num_pages: int = 64, page_size: int = 16, step_delay_s: float = 0.0):
        from omni.kv_pool import KVPool

        self.pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page_size, num_kv_heads=1, head_dim=1,
                           dtype=torch.float32, device="cpu")
        self.step_delay_s = step_delay_s
        self.batches: list[list[str]] = []  # request ids of every denoise_step call
        self.prefills: list[list[str]] = []

    def _rows(self, req) -> list[int]:
        tokens = 8 + 1 + (req.height // 16) * (req.width // 16)
        return [tokens] * (2 if req.use_cfg else 1)

    def pages_needed(self, req) -> int:
        return sum(self.pool.pages_for(n) for n in self._rows(req))

    def step_tokens(self, req) -> int:
        return sum(n - 8 for n in self._rows(req))

    def admit(self, req):
        if "FAULT_IN_ADMIT" in req.prompt:
            raise InjectedFault("injected fault in admit")
        pages = []
        for n in self._rows(req):
            pages.append(self.pool.allocate(n))
        return FakeState(req, pages, req.seed if req.seed is not None else 0)

    def prefill(self, states) -> None:
        self.prefills.append([s.request.request_id for s in states])

    def denoise_step(self, states) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.batches.append([s.request.request_id for s in states])
        for s in states:
            if FAULT_IN_STEP in s.request.prompt:
                raise InjectedFault("injected fault in denoise_step")
            s.value, s.step = s.value + 1.0, s.step + 1

    def decode(self, state) -> torch.Tensor:
        if FAULT_IN_DECODE in state.request.prompt:
            raise InjectedFault("injected fault in decode")
        return torch.full((2, 2, 3), int(state.value), dtype=torch.uint8)

    def release(self, state) -> None:
        for pages in state.rows:
            self.pool.release(pages)
        state.rows = []


MODEL_ID = "hunyuan_image3_tiny"  # the id the serving tests' apps answer to


def make_pipeline(recipe) -> TestPipeline:
    """``TestPipeline`` over the real tiny pipeline that ``recipe`` builds on the cpu platform."""
    from omni.models.hunyuan_image3.build import build_pipeline
    from omni.platform_manager import select

    return TestPipeline(build_pipeline(recipe, select("cpu"), progress=False))


def serve(recipe, pipeline, **options):
    """(server thread, engine) for ``pipeline``; the caller enters and stops them."""
    from omni.engine_loop import EngineLoop
    from omni.scheduler import Scheduler
    from omni.serving.app import ServingOptions, create_app

    engine = EngineLoop.around(Scheduler.from_recipe(pipeline, recipe)).start()
    assert engine.wait_ready(30)
    app = create_app(engine, ServingOptions.from_recipe(recipe, model_id=MODEL_ID, **options))
    return ServerThread(app), engine
