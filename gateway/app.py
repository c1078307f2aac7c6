"""The gateway's HTTP surface as one raw ASGI app (no framework: every microsecond of the data
path is the product): the OpenAI endpoints it proxies, ``/v1/models``, probes and metrics.

Each proxied request gets a request id and goes down the filter chain (``ladle.gateway.chain``);
the access log line, the audit record and the metrics are written once it ends, however it
ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ladle.api import parse_rfc3339
from ladle.audit import AuditLog
from ladle.gateway import audit as auditing
from ladle.gateway.apikeys import ApiKey
from ladle.gateway.chain import Handler
from ladle.gateway.cluster import Cluster
from ladle.gateway.context import ClientRequest, Outcome
from ladle.gateway.errors import GatewayError
from ladle.gateway.filters.authn import Authentication, unauthenticated
from ladle.gateway.filters.body import CLIENT_CLOSED as CLOSED_ERROR
from ladle.gateway.inbound import Inbound
from ladle.gateway.metrics import GatewayMetrics
from ladle.http_errors import unknown_endpoint, wrong_method
from ladle.logs import request_id_var

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from ladle.tracing import Tracing

log = logging.getLogger("ladle.gateway")
access = logging.getLogger("ladle.gateway.access")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROXIED = frozenset({b"/v1/completions", b"/v1/chat/completions", b"/tokenize", b"/detokenize"})
# What the gateway answers itself, to GET.
_LOCAL = (b"/v1/models", b"/metrics", b"/health/live", b"/health/ready")
# Incoming ids are echoed into headers and logs, so only a safe alphabet is honoured.
_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")
_JSON = [(b"content-type", b"application/json")]
# nginx's code for "the client closed the connection first", for logs and metrics only.
CLIENT_CLOSED = 499


@dataclass
class Lifecycle:
    """What the app asks of the process around it."""

    ready: Callable[[], str | None]  # why not ready, or None
    startup: Callable[[], Awaitable[None]]
    shutdown: Callable[[], Awaitable[None]]


async def _send_json(
    send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _end_span(span: Span, out: Outcome) -> None:
    """The request's span says how it ended: status, where it went, and what it cost."""
    span.set_attribute("http.response.status_code", out.status)
    if out.service is not None:
        span.set_attribute("ladle.service", out.service.name)
    if out.pod:
        span.set_attributes({"ladle.pod": out.pod, "ladle.variant": out.variant})
    span.set_attribute("ladle.attempts", out.attempts)
    if out.completion_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", out.completion_tokens)
    if out.error is not None:
        span.set_attribute("error.type", out.error)
    span.end()


class GatewayApp:
    def __init__(
        self,
        handler: Handler,
        cluster: Cluster,
        metrics: GatewayMetrics,
        lifecycle: Lifecycle,
        *,
        authentication: Authentication | None = None,
        access_log: bool = True,
        audit: AuditLog | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.handler = handler
        self.cluster = cluster
        self.metrics = metrics
        self.lifecycle = lifecycle
        self.authentication = authentication
        self.access_log = access_log
        self.audit = audit or AuditLog(None, "gateway")
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["raw_path"] if scope.get("raw_path") else scope["path"].encode()
            path = path.partition(b"?")[0]
            if scope["method"] == "POST" and path in PROXIED:
                await self._proxy(scope, receive, send, path)
            else:
                await self._local(scope, send, path)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # -- the proxied endpoints ------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, path: bytes) -> None:
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        rid = next((v for k, v in reversed(headers) if k == b"x-request-id"), None)
        request_id = rid.decode() if rid and _REQUEST_ID.fullmatch(rid) else uuid.uuid4().hex
        req = ClientRequest(request_id, b"POST", path, headers, arrival, receive)
        if self.tracing is not None:
            req.span = self.tracing.server(
                f"POST {path.decode()}",
                arrival,
                headers,
                {"http.request.method": "POST", "url.path": path.decode(),
                 "ladle.request_id": request_id},
            )  # fmt: skip
        token = request_id_var.set(request_id)
        out = Outcome(captured=[] if self.audit.text else None)

        async def send_reply(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                out.complete = True
            await send(message)

        try:
            await self.handler(req, send_reply, out)
        except GatewayError as exc:
            out.status = exc.status
            out.error = exc.message
            if not out.started:
                extra = [(b"x-request-id", request_id.encode()), *exc.headers]
                await _send_json(send, exc.status, exc.body(), extra)
        except asyncio.CancelledError:
            if out.error == CLOSED_ERROR:
                out.status = CLIENT_CLOSED
            elif out.started:
                raise  # a stream cut short: the connection closes mid-answer
            else:
                # Only the server cancels a request otherwise: its drain timeout ran out while
                # the request waited. A 503 that says so, which clients retry elsewhere.
                out.status = 503
                out.error = "the gateway stopped before the request was answered"
                err = GatewayError(503, f"{out.error}; retry", "shutting_down")
                extra = [(b"x-request-id", request_id.encode()), (b"retry-after", b"1")]
                await _send_json(send, 503, err.body(), extra)
        except Exception:
            log.exception("unhandled error", extra={"path": path.decode()})
            out.error = "internal error"
            if not out.started:
                out.status = 500
                err = GatewayError(
                    500, f"internal gateway error (request id {request_id})", "internal_error"
                )
                await _send_json(send, 500, err.body(), [(b"x-request-id", request_id.encode())])
        finally:
            self._account(out, req.key, req.parsed, loop.time() - arrival, request_id, path)
            if req.span is not None:
                _end_span(req.span, out)
            request_id_var.reset(token)

    def _account(
        self,
        out: Outcome,
        key: ApiKey | None,
        inbound: Inbound | None,
        seconds: float,
        request_id: str,
        path: bytes,
    ) -> None:
        svc = out.service
        ns, name = (svc.namespace, svc.name) if svc is not None else ("", "")
        m = self.metrics
        m.requests(ns, name, out.variant, str(out.status)).inc()
        if svc is not None:
            m.duration(ns, name).observe(seconds)
            if out.ttfb is not None:
                m.ttfb(ns, name).observe(out.ttfb)
            if out.overhead is not None:
                m.overhead(ns, name).observe(out.overhead)
        if self.audit.enabled:
            record = auditing.fields(path.decode(), out, key, inbound, seconds, self.audit.text)
            self.audit.write(request_id, record)
        if not self.access_log:
            return
        fields: dict[str, Any] = {
            "request_id": request_id,
            "path": path.decode(),
            "status": out.status,
            "duration_s": round(seconds, 4),
        }
        if inbound is not None:
            fields["model"] = inbound.model
            fields["stream"] = inbound.stream
        if svc is not None:
            fields.update(namespace=ns, service=name, variant=out.variant, pod=out.pod)
            fields["attempts"] = out.attempts
        if out.ttfb is not None:
            fields["ttfb_s"] = round(out.ttfb, 4)
        if out.fallback_from:
            fields["fallback_from"] = out.fallback_from
        if out.held_seconds:
            fields["held_s"] = round(out.held_seconds, 3)
        if key is not None:
            fields["key"] = key.name
        if out.tokens:
            fields["tokens"] = out.tokens
        if out.error:
            fields["error"] = out.error
        level = logging.WARNING if out.status >= 500 else logging.INFO
        access.log(level, "request", extra=fields)

    # -- local endpoints ------------------------------------------------------------------

    async def _local(self, scope: Scope, send: Send, path: bytes) -> None:
        method = scope["method"]
        if path == b"/metrics" and method == "GET":
            body = generate_latest(self.metrics.registry)
            headers = [
                (b"content-type", CONTENT_TYPE_LATEST.encode()),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif path in (b"/health/live", b"/health") and method == "GET":
            await _send_json(send, 200, b'{"status":"ok"}', [])
        elif path == b"/health/ready" and method == "GET":
            reason = self.lifecycle.ready()
            status = 200 if reason is None else 503
            await _send_json(send, status, json.dumps({"status": reason or "ok"}).encode(), [])
        elif path.startswith(b"/v1/models") and method == "GET" and not self._may_list(scope):
            err = unauthenticated()
            await _send_json(send, err.status, err.body(), err.headers)
        elif path == b"/v1/models" and method == "GET":
            await _send_json(send, 200, json.dumps(self._models()).encode(), [])
        elif path.startswith(b"/v1/models/") and method == "GET":
            wanted = path[len(b"/v1/models/") :].decode(errors="replace")
            cards = [c for c in self._models()["data"] if c["id"] == wanted]
            if cards:
                await _send_json(send, 200, json.dumps(cards[0]).encode(), [])
            else:
                err = GatewayError(404, f"the model {wanted!r} does not exist", "model_not_found")
                await _send_json(send, 404, err.body(), [])
        elif path in PROXIED or path in _LOCAL:
            allowed = "POST" if path in PROXIED else "GET"
            message = wrong_method(method, path.decode(errors="replace"), [allowed])
            err = GatewayError(405, message, "method_not_allowed")
            await _send_json(send, 405, err.body(), [(b"allow", allowed.encode())])
        else:
            known = [p.decode() for p in (*PROXIED, *_LOCAL)]
            err = GatewayError(
                404, unknown_endpoint(path.decode(errors="replace"), known), "not_found"
            )
            await _send_json(send, 404, err.body(), [])

    def _may_list(self, scope: Scope) -> bool:
        """Listing models needs a key too, when keys are configured (no limits are charged)."""
        if self.authentication is None:
            return True
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        now = asyncio.get_running_loop().time()
        return self.authentication.key(auth, now) is not None

    def _models(self) -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(parse_rfc3339(svc.created) or 0),
                "owned_by": f"{svc.namespace}/{svc.name}",
                # vLLM's field: an adapter's base model (None for a model itself).
                "parent": None if name == svc.model else svc.model,
            }
            for name, svc in self.cluster.models()
        ]
        return {"object": "list", "data": data}

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.lifecycle.startup()
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.lifecycle.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return
