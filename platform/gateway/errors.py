"""The gateway's errors and their one mapping to OpenAI-shaped HTTP errors.

`error_response` turns any exception into the HTTP answer a client gets: `InvalidRequestError`
(and its subclasses) a 400 naming the `param`, `APIError` its own status, `DeadlineExceededError`
a 504, `OverloadedError` and `UnavailableError` a 503 with Retry-After, any other `ReplicaError`
(an engine that died under the request) a 503 that names no internals, anything else a 500 that
names no internals either. `outcome_of` is how a failed request is counted in the metrics.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.responses import JSONResponse

from pdserve.errors import (DeadlineExceededError, InvalidRequestError, OverloadedError, PdserveError,
                            PromptTooLongError, ReplicaError)

log = logging.getLogger(__name__)


class APIError(PdserveError):
    """An HTTP error with OpenAI's shape that is not about the request's parameters."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def __reduce__(self):  # picklable through Ray
        return type(self), (self.status, self.message, self.type, self.code)


class UnavailableError(ReplicaError):
    """A pool cannot serve right now (replica died, engine dead); the client may retry."""


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(e: BaseException, request_id: str | None = None) -> JSONResponse:
    """The one mapping from exceptions to OpenAI-shaped HTTP errors. An error the request did
    not cause on purpose (a 500) says only that it happened and the request id: its text may
    hold internals, so it goes to the log, under that id."""
    if isinstance(e, APIError):
        return JSONResponse(error_body(e.message, e.type, None, e.code), e.status)
    if isinstance(e, InvalidRequestError):
        code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else None
        return JSONResponse(error_body(e.message, "invalid_request_error", e.param, code), 400)
    if isinstance(e, DeadlineExceededError):
        return JSONResponse(error_body(str(e), "timeout", None, "deadline_exceeded"), 504)
    where = f" (request id {request_id})" if request_id else ""
    if isinstance(e, (OverloadedError, UnavailableError)):
        return JSONResponse(error_body(f"{e}; retry shortly", "service_unavailable", None, 503), 503,
                            headers={"Retry-After": "1"})
    if isinstance(e, ReplicaError):  # the replica failed (its engine died), not the request: retryable
        log.warning("request %s: its replica failed: %r", request_id, e)
        return JSONResponse(error_body(f"the replica serving this request failed{where}; retry shortly",
                                       "service_unavailable", None, 503), 503, headers={"Retry-After": "1"})
    log.error("request %s failed: %r", request_id, e, exc_info=e)
    return JSONResponse(error_body(f"the server failed to complete this request{where}", "internal_server_error",
                                   None, 500), 500)


def outcome_of(e: BaseException) -> str:
    """How a failed request is counted (pdserve_requests' outcome label)."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return "aborted"  # the client left
    if isinstance(e, DeadlineExceededError):
        return "timeout"
    if isinstance(e, (OverloadedError, UnavailableError)):
        return "overloaded"
    if isinstance(e, APIError) and e.status in (401, 403):
        return "rejected"
    if isinstance(e, (InvalidRequestError, APIError)) and (not isinstance(e, APIError) or e.status < 500):
        return "invalid"
    return "error"
