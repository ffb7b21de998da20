"""The HTTP surface: ``create_app`` routes a FastAPI app to the handlers over an ``EngineHandle``.

Routes: OpenAI Images (/v1/images/generations, /v1/images/edits), chat
(/v1/chat/completions: vLLM-Omni's image chat, or an OpenAI text answer, plain
or streamed, with modalities ["text"]), /v1/models, /health and /metrics. The
handlers live in endpoints.py (text answers: chat_text.py); the names other
modules import from here are re-exported.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from omni.engine_handle import EngineHandle

from .endpoints import Api
from .errors import APIError, ClientGone
from .metrics import Metrics
from .options import FALLBACK_DEFAULTS, ModelHelpers, ServingOptions

__all__ = ["APIError", "ClientGone", "FALLBACK_DEFAULTS", "ModelHelpers", "ServingOptions", "create_app"]


def create_app(engine: EngineHandle, options: ServingOptions) -> FastAPI:
    """The app serving ``engine``; its metrics registry is its own (``app.state.metrics``)."""
    app = FastAPI(title="omni-run", version="0.1.0", docs_url=None, redoc_url=None)
    api = Api(engine, options, Metrics(engine))
    engine.observe_steps(lambda finished, dt: api.metrics.step.observe(dt))
    app.state.metrics, app.state.engine, app.state.api = api.metrics, engine, api

    @app.get("/health")
    async def health(request: Request):
        return await api.handle(request, "health", api.health, auth=False)

    @app.get("/metrics")
    async def metrics(request: Request):
        return Response(api.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return await api.handle(request, "models", api.models)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        return await api.handle(request, "models", lambda r, rid: api.model(model_id))

    @app.post("/v1/images/generations")
    async def images(request: Request):
        return await api.handle(request, "images", api.images)

    @app.post("/v1/images/edits")
    async def edits(request: Request):
        return await api.handle(request, "edits", api.edits)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await api.handle(request, "chat", api.chat)

    return app
