"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Clients (the OpenAI SDK, gateways) branch on the status; ``type`` and ``code`` say why.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ladle import json_body
from ladle.http_errors import error_info, unknown_endpoint, wrong_method
from ladle.runtime.errors import RequestError
from ladle.runtime.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("ladle.server")

# pydantic's errors for a value that is not a mapping where a model was expected.
_NOT_A_MAPPING = frozenset({"model_attributes_type", "model_type", "dict_type"})


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return error_body(self.status_code, self.message, self.code, self.param)


def error_body(
    status_code: int, message: str, code: str | None = None, param: str | None = None
) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(**error_info(status_code, message, code, param)))


def error_response(
    status_code: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = error_body(status_code, message, code, param)
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


def invalid_request(exc: RequestError) -> APIError:
    return APIError(400, str(exc), code="invalid_parameter", param=exc.param)


def from_validation_errors(errors: list[Any], body: Any = None) -> APIError:
    """The first pydantic error, with ``param`` as the dotted field path; a body that is no
    JSON object at all (broken, empty, an array, form data) says so, with ``param`` null."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        message = first.get("ctx", {}).get("error", "invalid JSON")
        # The position counts characters of the decoded text; line and column come from it,
        # so bytes are decoded as json.loads decodes them (never measured against "").
        if isinstance(body, bytes | bytearray):
            body = bytes(body).decode(json.detect_encoding(body), "replace")
        loc = first.get("loc") or ()
        if isinstance(body, str) and loc and isinstance(loc[-1], int):
            return _not_an_object(json_body.broken(json.JSONDecodeError(message, body, loc[-1])))
        return _not_an_object(f"the request body is not valid JSON: {message}")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, RequestError):
        return invalid_request(cause)
    # Union bodies (/tokenize) put the model's class name in the path: not a field.
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not str(p)[:1].isupper()]
    if not loc:
        if first.get("type") == "missing":
            return _not_an_object(json_body.EMPTY)
        if first.get("type") in _NOT_A_MAPPING:
            return _not_an_object(json_body.not_an_object(first.get("input")))
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    return APIError(400, message, code="invalid_parameter", param=param)


def _not_an_object(message: str) -> APIError:
    return APIError(400, message, code=json_body.CODE)


def install_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        level = logging.WARNING if exc.status_code in (429, 500, 503) else logging.INFO
        log.log(
            level,
            "request rejected",
            extra={
                "status": exc.status_code,
                "code": exc.code,
                "param": exc.param,
                "error": exc.message,
                "path": request.url.path,
            },
        )
        return error_response(exc.status_code, exc.message, exc.code, exc.param, exc.headers)

    async def on_request_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestError)
        return await on_api_error(_, invalid_request(exc))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        content_type = request.headers.get("content-type")
        if isinstance(exc, RequestValidationError) and not json_body.is_json(content_type):
            # FastAPI parsed nothing: the body may well be JSON, sent as form data by curl -d.
            message = json_body.wrong_content_type(str(content_type))
            return await on_api_error(request, _not_an_object(message))
        body = exc.body if isinstance(exc, RequestValidationError) else None
        return await on_api_error(request, from_validation_errors(list(exc.errors()), body))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = str(exc.detail)
        path = request.url.path
        if exc.status_code == 404:
            known = [str(getattr(route, "path", "")) for route in app.routes]
            message = unknown_endpoint(path, known)
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "").split(", ")
            message = wrong_method(request.method, path, filter(None, allowed))
        return error_response(
            exc.status_code, message, code.get(exc.status_code), headers=exc.headers
        )

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
