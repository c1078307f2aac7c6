"""Response cache: a deterministic request's complete answer, kept per service revision, is
served again without a pod; a failed, cut or fallback answer is never kept."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ladle.gateway.cache import Entry, ResponseCache, cache_key, cacheable
from ladle.gateway.context import ClientRequest, Outcome, Send
from ladle.gateway.metrics import GatewayMetrics
from ladle.gateway.routes import Service


@dataclass
class Cache:
    cache: ResponseCache
    metrics: GatewayMetrics

    async def on_request(self, req: ClientRequest, send: Send, out: Outcome) -> bool:
        service = req.service
        req.cache_key = key = self._key(service, req)
        if key is None:
            return False
        entry = self.cache.get(key)
        out.cache = "miss" if entry is None else "hit"
        self.metrics.cache(*service.key, out.cache).inc()
        if entry is not None:
            await self._replay(entry, service, req, send, out)
            return True
        if out.captured is None:
            out.captured = []
        return False

    def on_response(self, req: ClientRequest, out: Outcome, ok: bool) -> None:
        if ok and req.cache_key is not None and out.fallback_from is None:
            self._store(req.cache_key, req, out)

    def _key(self, service: Service, req: ClientRequest) -> bytes | None:
        """The request's key, if the service caches and the answer is deterministic."""
        if not service.response_cache or not cacheable(req.inbound.doc):
            return None
        live = [variant for variant, weight in service.weights if weight > 0]
        if len(live) != 1:
            return None  # a canary split: which variant will answer is not known yet
        revision = service.revision(live[0])
        if revision is None:
            return None  # its pods are changing revision, or none has been reported yet
        scope = req.key.cache_scope if req.key is not None else ""
        return cache_key(service.key, revision, live[0], scope, req.path, req.inbound.doc)

    async def _replay(
        self, entry: Entry, service: Service, req: ClientRequest, send: Send, out: Outcome
    ) -> None:
        out.service, out.status, out.started = service, entry.status, True
        out.ttfb = asyncio.get_running_loop().time() - req.arrival
        headers = [*entry.headers, (b"x-request-id", req.request_id.encode())]
        headers.append((b"x-ladle-cache", b"hit"))
        await send({"type": "http.response.start", "status": entry.status, "headers": headers})
        await send({"type": "http.response.body", "body": entry.body})

    def _store(self, key: bytes, req: ClientRequest, out: Outcome) -> None:
        if out.status != 200 or out.failed or out.error or out.reply_headers is None:
            return
        kept = tuple(
            (k, v) for k, v in out.reply_headers if k not in (b"x-request-id", b"x-ladle-cache")
        )
        body = b"".join(out.captured or [])
        evictions = self.cache.evictions
        self.cache.put(key, Entry(out.status, kept, body, req.inbound.stream))
        self.metrics.cache_bytes.set(self.cache.bytes)
        self.metrics.cache_entries.set(len(self.cache))
        self.metrics.cache_evictions.inc(self.cache.evictions - evictions)
