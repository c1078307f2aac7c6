"""The outermost layer of every request: id, API key, body size, in-flight count, last-resort
500, and its audit record once the response has gone.

It is plain ASGI rather than ``BaseHTTPMiddleware`` so that streamed responses pass through
untouched and a client disconnect still reaches the handler.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ladle.audit import fingerprint
from ladle.logs import request_id_var
from ladle.runtime.server.audit import AuditEntry
from ladle.runtime.server.errors import error_response
from ladle.runtime.server.lifecycle import OPEN_PATHS, ServerState

log = logging.getLogger("ladle.server")

# Incoming ids are echoed into headers and logs, so only a safe alphabet is honoured.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")


class RequestTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds the {limit}-byte limit")


class ServerMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        incoming = headers.get("x-request-id", "")
        request_id = incoming if _REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        started = False
        status = 0
        open_path = scope["path"] in OPEN_PATHS
        audit = self.state.audit
        entry = None
        if audit.enabled and not open_path:
            entry = AuditEntry(key=_key_name(headers), text=audit.text)
            scope["state"]["audit"] = entry
        arrival = time.monotonic()
        tracing = self.state.tracing
        span = None
        if tracing is not None and not open_path:
            span = tracing.server(
                f"{scope['method']} {scope['path']}",
                arrival,
                scope["headers"],
                {"http.request.method": scope["method"], "url.path": scope["path"],
                 "ladle.request_id": request_id},
            )  # fmt: skip
            scope["state"]["span"] = span

        async def send_with_id(message: Message) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            elif entry is not None and status >= 400 and entry.error is None:
                entry.error = _error_message(message.get("body", b""))
            await send(message)

        if not open_path:
            self.state.http_started()
        try:
            rejection = None if open_path else self._reject_early(headers)
            if rejection is not None:
                await rejection(scope, receive, send_with_id)
            else:
                await self.app(scope, self._limited(receive), send_with_id)
        except Exception:
            log.exception("unhandled error", extra={"path": scope["path"]})
            if not started:
                response = error_response(
                    500, f"internal server error (request id {request_id})", "internal_error"
                )
                await response(scope, receive, send_with_id)
        finally:
            if not open_path:
                self.state.http_finished()
            if entry is not None:
                fields = entry.fields(scope["path"], status or 500, time.monotonic() - arrival)
                audit.write(request_id, fields)
            if span is not None:
                span.set_attribute("http.response.status_code", status or 500)
                span.end()
            request_id_var.reset(token)

    def _reject_early(self, headers: Headers) -> JSONResponse | None:
        """A 401 or 413 response decided from the headers alone, before the body is read."""
        keys = self.state.api_keys
        if keys.enabled:
            scheme, _, presented = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not keys.check(presented.strip()):
                return error_response(
                    401,
                    "a valid API key is required (Authorization: Bearer <key>)",
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        declared = headers.get("content-length", "")
        limit = self.state.settings.max_request_size
        if declared.isdigit() and int(declared) > limit:
            exc = RequestTooLarge(limit)
            return error_response(413, str(exc.detail), "request_too_large")
        return None

    def _limited(self, receive: Receive) -> Receive:
        """Enforce the size limit on bodies without a Content-Length (chunked uploads)."""
        limit = self.state.settings.max_request_size
        received = 0

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLarge(limit)
            return message

        return receive_limited


def _key_name(headers: Headers) -> str | None:
    """The presented key's fingerprint (the server's keys have no names), never the key."""
    scheme, _, presented = headers.get("authorization", "").partition(" ")
    presented = presented.strip()
    return fingerprint(presented) if scheme.lower() == "bearer" and presented else None


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI error body, for the audit record."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message if isinstance(message, str) else None
