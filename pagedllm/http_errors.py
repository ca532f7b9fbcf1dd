"""The HTTP API's errors: the error types a route raises, their OpenAI-shaped body
(`{"error": {"message", "type", "param", "code"}}`) and their OpenAPI descriptions.

Shared by the OpenAI server (entrypoints/openai/) and the job service's routes (jobs/routes.py),
so neither package imports the other for them; the handlers that answer with these bodies are
installed by the app (entrypoints/openai/errors.py).
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class APIError(Exception):
    """An error a client caused (or must be told about), answered with `status_code`."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.headers = headers


class BadRequestError(APIError):
    pass


class NotFoundError(APIError):
    status_code = 404
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    default_code = "model_not_found"

    def __init__(self, message: str):
        super().__init__(message, param="model")


class ConflictError(APIError):
    status_code = 409
    default_code = "conflict"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "server_error"
    default_code = "service_unavailable"


class RequestTimeoutError(APIError):
    """The request did not finish within the server's --request-timeout (queue time included)."""

    status_code = 504
    error_type = "server_error"
    default_code = "timeout"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.error_type, exc.param, exc.code), status_code=exc.status_code,
                        headers=exc.headers)


ERROR_DESCRIPTIONS = {
    400: "invalid request: the message names the field (`param`) and the limit",
    401: "missing or wrong API key",
    404: "unknown model, job, checkpoint or route",
    409: "the request conflicts with the resource's state",
    503: "overloaded (`queue_full`, with Retry-After), loading, or unavailable",
    504: "not finished within the server's --request-timeout",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, used for every failure."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for these error statuses, each with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}
