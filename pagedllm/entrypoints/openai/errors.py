"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Clients (the `openai` package, lm-evaluation-harness, curl scripts) parse this one shape, so
every way a request can fail — a pydantic validation error, undecodable JSON, an unknown route,
a bad API key, a full queue, or a bug of ours — is answered in it. FastAPI's default 422 for
validation errors becomes OpenAI's 400.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pagedllm.entrypoints.openai.async_engine import Disconnected
from pagedllm.http_errors import APIError, BadRequestError, error_body, error_response

logger = logging.getLogger("pagedllm.server")

HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def param_from_message(message: str, fields: Sequence[str]) -> str | None:
    """The request field a validation message is about, when it starts with one (our engine's
    messages start with the argument's name: "temperature must be >= 0, got -1")."""
    match = re.match(r"[A-Za-z_]+", message)
    return match.group(0) if match and match.group(0) in fields else None


def _loc_to_param(loc: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif isinstance(part, str) and not part.startswith(("function-", "list[", "str", "int", "json-", "literal[", "bool")):
            text += f".{part}" if text else part
    return text or None


def validation_message(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable sentence from pydantic's error list, and the first offending field."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"the request body is not valid JSON: {ctx.get('error', 'parse error')}", None
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    errors = _most_specific(errors)
    first = errors[0]
    pieces = []
    for err in errors[:5]:
        param = _loc_to_param(err.get("loc", ()))
        msg = err.get("msg", "invalid value").removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unrecognized request argument"
        pieces.append(f"{param}: {msg}" if param else msg)
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(dict.fromkeys(pieces)) + more, _loc_to_param(first.get("loc", ()))


def _most_specific(errors: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A field of several shapes (a prompt: text, texts, ids, id lists) fails once per shape; when
    one shape failed on its value (too long, not valid Unicode), the others' "should be a valid
    list" are noise: keep the errors about values where there are any."""
    about_values = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    return about_values or list(errors)


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(exc.errors())
    return error_response(BadRequestError(message, param))


async def _http_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    codes = {404: "not_found", 405: "method_not_allowed"}
    body = error_body(str(exc.detail), error_type, None, codes.get(exc.status_code))
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(allowed_methods(request))
    return JSONResponse(body, status_code=exc.status_code, headers=headers or None)


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's own 405 names only the first route's)."""
    routes = request.app.router.routes
    return [method for method in HTTP_METHODS
            if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)]


async def _disconnected_handler(request: Request, exc: Exception) -> JSONResponse:
    # Nobody is listening any more; 499 is nginx's "client closed request" for the access log.
    return JSONResponse(error_body("client disconnected", "invalid_request_error"), status_code=499)


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    """A bug of ours: log it, answer 500 in OpenAI's shape, keep serving (the engine loops run on
    their own threads and never see this exception)."""
    logger.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    body = error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")
    return JSONResponse(body, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Disconnected, _disconnected_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
