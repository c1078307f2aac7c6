"""What both HTTP servers (``ladle serve`` and ``ladle gateway``) share in their errors: the
OpenAI ``type`` for each status, so that a client branching on it meets one table whichever
server answered, and the words for a request that names no endpoint they have, or the wrong
method (a base URL without ``/v1`` and a misspelt path are a newcomer's first 404s, so the
answer names the path that exists).

Only the standard library: the gateway runs without FastAPI.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def error_info(status: int, message: str, code: str | None, param: str | None) -> dict[str, Any]:
    """The ``error`` object of an OpenAI error body."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"message": message, "type": kind, "param": param, "code": code}


def unknown_endpoint(path: str, endpoints: Iterable[str]) -> str:
    known = sorted(set(endpoints))
    message = f"no such endpoint: {path}"
    if "/v1" + path in known:
        return f"{message}; did you mean /v1{path}? (the OpenAI base URL ends in /v1)"
    close = difflib.get_close_matches(path, known, n=1, cutoff=0.8)
    return f"{message}; did you mean {close[0]}?" if close else message


def wrong_method(method: str, path: str, allowed: Iterable[str]) -> str:
    methods = sorted(set(allowed) - {"HEAD"})
    message = f"method {method} is not allowed on {path}"
    return f"{message}; use {' or '.join(methods)}" if methods else message
