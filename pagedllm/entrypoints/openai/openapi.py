"""The OpenAPI document says what the routes really answer: OpenAI-shaped errors, not FastAPI's 422.

Routers declare the error statuses their routes can give with `error_responses(...)`; the app's
schema then drops FastAPI's automatic 422 (our validation errors are 400s, see errors.py) and, when
an API key is set, marks every protected route with the bearer scheme and its 401. Schemathesis
fuzzes the server against this document (tests/entrypoints/openai/test_server_schema_fuzz.py), so a
route answering a status or a body the document does not name fails the suite.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedllm.http_errors import ERROR_DESCRIPTIONS


def install_openapi(app: FastAPI, protected: bool, open_paths: frozenset[str]) -> None:
    """Replace app.openapi with a generator that documents our errors (and the API key when `protected`)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            document_errors(schema, protected, open_paths)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document_errors(schema: dict[str, Any], protected: bool, open_paths: frozenset[str]) -> None:
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if responses.pop("422", None) is not None and "400" not in responses:
                responses["400"] = {"description": ERROR_DESCRIPTIONS[400],
                                    "content": {"application/json": {"schema": error_ref}}}
            if protected and path not in open_paths:
                operation["security"] = [{"bearer": []}]
                responses["401"] = {"description": ERROR_DESCRIPTIONS[401],
                                    "content": {"application/json": {"schema": error_ref}}}
    components = schema.setdefault("components", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(unused, None)
    if protected:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
