"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Owns: `APIError` (what handlers raise), turning pydantic validation errors and nanoserve's
`InvalidRequestError` into a 400 that names the offending field, and the exception handlers
that make every failure, including FastAPI's own 404/405/422, leave in that shape.
Refuses: deciding what is valid; the protocol models and the engine's checks do that.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.errors import InvalidRequestError

log = logging.getLogger("nanoserve.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "requests",
         503: "service_unavailable",
         500: "internal_server_error"}


class APIError(Exception):
    """An error a client caused or must wait out; leaves as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, TYPES.get(self.status, "invalid_request_error"), self.param,
                          self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_invalid_request(error: InvalidRequestError) -> APIError:
    return bad_request(error.message, error.param)


def param_of(loc: Sequence[str | int]) -> str | None:
    """`("body", "messages", 0, "content")` -> `"messages[0].content"`; pydantic's union
    branch names (`str`, `list[int]`, `function-after[...]`) are dropped."""
    parts = [part for part in loc if part != "body"]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _is_type_tag(part):
            continue
        else:
            text += f".{part}" if text else part
    return text or None


def _is_type_tag(part: str) -> bool:
    return (part in {"str", "int", "float", "bool", "dict", "list"} or "[" in part
            or part.startswith(("function-", "json-or-python", "lax-", "constrained-")))


def from_validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """The first problem pydantic found, as a 400 naming its field."""
    if not errors:
        return bad_request("the request body is invalid", "body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg', '')}", "body")
    chosen, message = _explain(errors)
    param = param_of(chosen.get("loc", ())) or "body"
    return bad_request(f"{param}: {message}", param)


def _explain(errors: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The most telling error and its message. A field that takes one of several types fails
    once per type; the branch that got deepest into the value is the one the client meant."""
    first = errors[0]
    field = _field(first)
    branches = [e for e in errors if _field(e) == field and any(_is_type_tag(str(p)) for p in e["loc"])]
    if not branches:
        return first, first.get("msg", "invalid value")
    deepest = max(branches, key=_depth)
    if _depth(deepest) > len(field):
        return deepest, deepest.get("msg", "invalid value")
    types = dict.fromkeys(next(str(p) for p in e["loc"] if _is_type_tag(str(p))) for e in branches)
    return first, f"expected one of: {', '.join(types).replace('constrained-', '')}"


def _field(error: dict[str, Any]) -> tuple:
    loc = error.get("loc", ())
    prefix = []
    for part in loc:
        if isinstance(part, str) and _is_type_tag(part):
            break
        prefix.append(part)
    return tuple(prefix)


def _depth(error: dict[str, Any]) -> int:
    return sum(1 for part in error.get("loc", ()) if not (isinstance(part, str) and _is_type_tag(part)))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, error: InvalidRequestError) -> JSONResponse:
        return from_invalid_request(error).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, error: RequestValidationError) -> JSONResponse:
        return from_validation_error(error.errors()).response()

    @app.exception_handler(ValidationError)
    async def _pydantic(_: Request, error: ValidationError) -> JSONResponse:
        return from_validation_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return APIError(error.status_code, str(error.detail), code=code, headers=error.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}").response()
