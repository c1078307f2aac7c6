"""The gateway's filter chain, in Envoy's order: authentication, rate limit, body, route,
response cache, then the router (deadlines, retries, upstream I/O) over the cluster (picking,
breaker, outlier detection, hold queue).

A filter sees one request's context and the rest of the chain, and may answer itself (raise a
``GatewayError``), pass the request on, or act on the way back (the rate limit charges the
tokens the answer used; the cache keeps the answer). Filters that a configuration does not
need (no API keys, no response cache) are left out of the chain rather than made no-ops.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from ladle.gateway.context import ClientRequest, Outcome, Send

Handler = Callable[[ClientRequest, Send, Outcome], Awaitable[None]]


class Filter(Protocol):
    async def __call__(
        self, req: ClientRequest, send: Send, out: Outcome, next_: Handler
    ) -> None: ...


def chain(filters: Sequence[Filter], last: Handler) -> Handler:
    """One handler that runs ``filters`` in order, then ``last``."""
    handler = last
    for f in reversed(filters):
        handler = _bind(f, handler)
    return handler


def _bind(f: Filter, next_: Handler) -> Handler:
    async def run(req: ClientRequest, send: Send, out: Outcome) -> None:
        await f(req, send, out, next_)

    return run
