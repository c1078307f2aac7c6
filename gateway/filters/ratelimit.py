"""Rate limit: a key's requests are admitted against its buckets on the way in, and the tokens
its answer used are charged on the way out, however the request ended."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ladle.gateway.context import ClientRequest, Outcome, Send
from ladle.gateway.errors import GatewayError
from ladle.gateway.metrics import GatewayMetrics


@dataclass
class RateLimit:
    metrics: GatewayMetrics

    async def on_request(self, req: ClientRequest, send: Send, out: Outcome) -> bool:
        key = req.key
        if key is None:  # only behind the authentication filter, which sets it
            raise RuntimeError("the rate limit filter runs after authentication")
        refusal = key.limiter.admit(req.arrival)
        if refusal is not None:
            self.metrics.rate_limited.labels(key.name, refusal.limit).inc()
            retry = str(max(1, round(refusal.retry_after + 0.5))).encode()
            raise GatewayError(
                429, refusal.message, "rate_limit_exceeded", headers=[(b"retry-after", retry)]
            )
        return False

    def on_response(self, req: ClientRequest, out: Outcome, ok: bool) -> None:
        if req.key is not None and out.tokens:
            req.key.limiter.charge_tokens(asyncio.get_running_loop().time(), out.tokens)
