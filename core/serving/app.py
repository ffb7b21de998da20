"""The HTTP surface: ``create_app`` routes a FastAPI app to the handlers over an ``EngineHandle``.

Routes: OpenAI Images (/v1/images/generations, /v1/images/edits), chat
(/v1/chat/completions: vLLM-Omni's image chat, or an OpenAI text answer, plain
or streamed, with modalities ["text"]), /v1/models, /health and /metrics. The
handlers live in endpoints.py (text answers: chat_text.py); the names other
modules import from here are re-exported.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from omni.engine_handle import EngineHandle

from .endpoints import Api
from .errors import APIError, ClientGone, error_response
from .metrics import Metrics
from .openapi import install_openapi
from .options import FALLBACK_DEFAULTS, ModelHelpers, ServingOptions

__all__ = ["APIError", "ClientGone", "FALLBACK_DEFAULTS", "ModelHelpers", "ServingOptions", "create_app"]


def create_app(engine: EngineHandle, options: ServingOptions) -> FastAPI:
    """The app serving ``engine``; its metrics registry is its own (``app.state.metrics``)."""
    app = FastAPI(title="omni-run", version="0.1.0", docs_url=None, redoc_url=None)
    api = Api(engine, options, Metrics(engine))
    engine.observe_steps(lambda finished, dt: api.metrics.step.observe(dt))
    app.state.metrics, app.state.engine, app.state.api = api.metrics, engine, api
    _openai_errors(app)

    @app.get("/health")
    async def health(request: Request):
        return await api.handle(request, "health", api.health, auth=False)

    @app.get("/metrics")
    async def metrics(request: Request):  # behind the key too: queue depth and traffic are not public facts
        return await api.handle(request, "metrics", lambda r, rid: _metrics(api))

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="omni-run API")

    @app.get("/v1/models")
    async def models(request: Request):
        return await api.handle(request, "models", api.models)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        return await api.handle(request, "models", lambda r, rid: api.model(model_id))

    @app.post("/v1/images/generations")
    async def images(request: Request):
        return await api.handle(request, "images", api.images)

    @app.post("/v1/images/edits", include_in_schema=options.helpers.max_images > 0)  # documented where it edits
    async def edits(request: Request):
        return await api.handle(request, "edits", api.edits)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await api.handle(request, "chat", api.chat)

    install_openapi(app, options)
    return app


async def _metrics(api: Api) -> Response:
    return Response(api.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _openai_errors(app: FastAPI) -> None:
    """Routing answers (404 no such path, 405 wrong method, 422) in the OpenAI error shape, not FastAPI's."""

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        what = f"{request.method} {request.url.path}"
        message = {404: f"no such endpoint: {what}", 405: f"method not allowed: {what}"}.get(e.status_code, e.detail)
        return error_response(APIError(e.status_code, message, code=kind, headers=dict(e.headers or {})),
                              request.headers.get("x-request-id", ""))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(APIError(422, f"{field or 'request'}: {first.get('msg', 'invalid')}", param=field),
                              request.headers.get("x-request-id", ""))
