"""Answers other than 200, in the OpenAI error shape ``{"error": {"message", "type", "param", "code", "request_id"}}``.

Bad input is a 400 naming the field, an unknown model 404, overload 429 with
Retry-After, not ready 503 with Retry-After, a failure inside the pipeline
500 with a request id that the server log also carries.
"""
from __future__ import annotations

import re

from omni.scheduler_errors import EngineUnavailable, QueueFull, RequestInvalid, RequestTooLarge


class APIError(Exception):
    """An answer other than 200, in the OpenAI error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code, self.headers = code, headers or {}


class ClientGone(Exception):
    """The client disconnected before its images were ready."""


def error_response(e: APIError, rid: str) -> JSONResponse:
    from fastapi.responses import JSONResponse  # here: the CLI checks its flags with APIError, without FastAPI

    body = {"message": e.message, "type": e.type, "param": e.param, "code": e.code, "request_id": rid}
    return JSONResponse({"error": body}, status_code=e.status, headers=e.headers)


def shutting_down() -> APIError:
    """The answer to a call still running (or arriving) when the server is told to stop."""
    return APIError(503, "the server is shutting down; this request was cancelled: retry it (on another replica, "
                         "or here once the server is back)", type="server_error", code="shutting_down",
                    headers={"Retry-After": "5"})


def internal_error(rid: str) -> APIError:
    return APIError(500, f"internal error while generating; request id {rid} (the server log has the details)",
                    type="server_error", code="internal_error")


def submit_refused(e: QueueFull | RequestTooLarge | EngineUnavailable, too_large: str = "size") -> APIError:
    """The answer to a submit the scheduler turned down (``too_large``: the field blamed for a request that
    can never fit, ``size`` for an image, ``max_tokens`` for a text answer)."""
    if isinstance(e, QueueFull):
        return APIError(429, f"{e}; retry after {e.retry_after_s}s", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(e.retry_after_s)})
    if isinstance(e, RequestTooLarge):
        return APIError(400, str(e), param=too_large, code="request_too_large")
    if isinstance(e, RequestInvalid):  # "request <id>: <field>: why": the model names the field it refuses
        field = re.match(r"request \S+: ([a-z_]+):", str(e))
        return APIError(400, str(e), param=field.group(1) if field else None, code="unsupported_value")
    return APIError(503, f"not ready: {e}", type="server_error", code="engine_unavailable",
                    headers={"Retry-After": "5"})
