"""One request's context along the gateway's filter chain (``ladle.gateway.chain``): what the
client asked (``ClientRequest``, filled in as the filters learn it: the key, the body, the
route) and what happened to it (``Outcome``), which the access log, the metrics, the audit
trail, the token bucket and the response cache all read afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ladle.gateway.apikeys import ApiKey
from ladle.gateway.inbound import Inbound
from ladle.gateway.routes import Service

if TYPE_CHECKING:
    from opentelemetry.trace import Span

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
HeaderList = list[tuple[bytes, bytes]]


@dataclass(slots=True)
class ClientRequest:
    """One request as the filters see it; times are ``loop.time()``."""

    request_id: str
    method: bytes
    path: bytes
    headers: HeaderList
    arrival: float
    receive: Receive
    # The client's own deadline (x-ladle-timeout), infinity without one: the body filter's.
    deadline: float = float("inf")
    key: ApiKey | None = None  # the authentication filter's
    parsed: Inbound | None = None  # the body filter's
    route: Service | None = None  # the route filter's
    band: int = 0  # the priority filter's: the request's priority band, 0 the highest
    tenant: str = ""  # the priority filter's: whose fair share the request counts against
    cache_key: bytes | None = None  # the cache filter's, when the answer may be kept
    watcher: asyncio.Task[None] | None = None  # the body filter's watch for a hang-up
    span: Span | None = None  # the request's trace span, when the gateway traces
    _by_name: dict[bytes, bytes] | None = field(default=None, repr=False)

    def header(self, name: bytes) -> bytes | None:
        """A request header by its lowercase name (the last, if repeated)."""
        if self._by_name is None:
            self._by_name = dict(self.headers)
        return self._by_name.get(name)

    @property
    def inbound(self) -> Inbound:
        """The parsed body, for the filters after the body filter."""
        if self.parsed is None:
            raise RuntimeError("the body is read by the body filter, before this one")
        return self.parsed

    @property
    def service(self) -> Service:
        """The service the model names, for the filters after the route filter."""
        if self.route is None:
            raise RuntimeError("the route is chosen by the route filter, before this one")
        return self.route


@dataclass(slots=True)
class Outcome:
    """What happened, for the access log, the metrics and the token bucket."""

    status: int = 0
    service: Service | None = None
    variant: str = ""
    pod: str = ""
    attempts: int = 0
    fallback_from: str | None = None
    held_seconds: float = 0.0
    tokens: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # The response body as sent, when someone needs it afterwards (audit text, the cache).
    captured: list[bytes] | None = None
    # The response cache's verdict for this request: hit, miss, or None (not cacheable).
    cache: str | None = None
    # The headers sent with the response, when it came from a pod.
    reply_headers: HeaderList | None = None
    error: str | None = None
    # The service failed this request (a stream cut short, a deadline of its own): a breaker
    # failure even though the status sent was 200.
    failed: bool = False
    started: bool = False
    # The last piece of the answer went to the client: a hang-up now cuts nothing short.
    complete: bool = False
    ttfb: float | None = None
    overhead: float | None = None
