"""The scheduler's refusals: what a client is told when its request is not (or no longer) served.

The serving layer maps each to its HTTP status (``omni.serving.errors``); replicas send them across
process boundaries by class name (``omni.parallel.replica_link``).
"""
from __future__ import annotations


class SchedulerError(RuntimeError):
    """Base class of the scheduler's own refusals."""


class QueueFull(SchedulerError):
    """More waiting requests than ``serving.max_queue``; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLarge(SchedulerError, ValueError):
    """The request can never be admitted: it needs more KV pages than the whole pool."""


class RequestInvalid(SchedulerError, ValueError):
    """The model refuses the request as asked (a field it cannot honour); the message names the field."""


class RequestCancelled(SchedulerError):
    """The request was cancelled (client gone or timed out) before it finished."""


class EngineUnavailable(SchedulerError):
    """The engine is not ready yet, or its loop died; ``reason`` says which."""
