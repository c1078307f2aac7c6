"""OpenAI-shaped error bodies: ``{"error": {"message", "type", "param", "code"}}``.

The runtime's own errors pass through untouched; these are the gateway's answers (no route,
over a limit, breaker open, timed out), shaped the same so that clients branch on one format.
"""

from __future__ import annotations

import json

from ladle.http_errors import error_info


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or []

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": error_info(status, message, code, param)}).encode()


def sse_error(status: int, message: str, code: str) -> bytes:
    """The event that ends a stream the gateway cannot finish (the OpenAI SDK raises on it)."""
    return b"data: " + error_body(status, message, code) + b"\n\n"
