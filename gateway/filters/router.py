"""Router: the request's deadlines, its attempts at pods (a retry goes to another pod), and the
answer relayed to the client as it arrives. The last filter: the cluster says where to go."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ladle.api import FALLBACK_HEADER
from ladle.gateway.cluster import Ask, Cluster
from ladle.gateway.context import ClientRequest, HeaderList, Outcome, Send
from ladle.gateway.errors import GatewayError
from ladle.gateway.inbound import Inbound
from ladle.gateway.metrics import GatewayMetrics
from ladle.gateway.relay import relay_events, usage_tokens
from ladle.gateway.routes import Pod, Service
from ladle.gateway.service_state import ServiceState
from ladle.gateway.upstream import Pool, Response, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from ladle.tracing import Tracing

# Never forwarded in either direction (RFC 9110 §7.6.1), or set by the gateway itself.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"trailer",
        b"upgrade",
        b"proxy-authorization",
        b"proxy-authenticate",
        b"host",
        b"content-length",
        b"x-request-id",
    }
)
_NOT_RETURNED = _HOP_BY_HOP | {b"date", b"server"}
# The client's trace context, replaced by the attempt's own when the gateway traces.
_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
_RETRY_STATUSES = frozenset({502, 503, 504})
# The gateway's own answers that mean the service failed (a missing pod is the hold's business).
_BREAKER_FAILURES = frozenset({"first_token_timeout", "request_timeout", "upstream_unavailable"})


@dataclass(slots=True)
class Attempt(Ask):
    """What every attempt of one request shares, and what binding it to a pod needs."""

    state: ServiceState
    req: ClientRequest
    body: bytes
    headers: HeaderList
    deadline: float  # the earlier of the client's and the service's
    add_usage: bool  # asked the pod for usage the client did not ask for: strip it
    count_usage: bool

    def expired(self) -> GatewayError:
        """The answer when the deadline passes: the client's own (not the service's fault) or
        the service's ``timeouts.requestSeconds`` (a breaker failure)."""
        if self.req.deadline <= self.deadline:
            return GatewayError(504, "the request's own deadline passed", "deadline_exceeded")
        return GatewayError(504, "the service's request timeout passed", "request_timeout")


@dataclass(slots=True)
class Router:
    cluster: Cluster
    pool: Pool
    metrics: GatewayMetrics
    # Read every response's usage (the audit trail's token counts), not only limited keys'.
    count_usage: bool = False
    tracing: Tracing | None = None

    async def __call__(self, req: ClientRequest, send: Send, out: Outcome) -> None:
        loop = asyncio.get_running_loop()
        admitted = self.cluster.admit(req.service, loop.time(), out)
        state = admitted.state
        level = state.arrive(req.band, req.tenant)
        success: bool | None = None
        try:
            success = await self._serve(state, level, req, send, out)
        except GatewayError as exc:
            if exc.code in _BREAKER_FAILURES:
                success = False
            raise
        finally:
            state.depart(req.band, req.tenant)
            self.cluster.finish(admitted, success, loop.time())

    async def _serve(
        self,
        state: ServiceState,
        level: int,
        req: ClientRequest,
        send: Send,
        out: Outcome,
    ) -> bool:
        """Run the attempts; True when the service did its job (for the breaker)."""
        loop = asyncio.get_running_loop()
        service = state.service
        limited = req.key is not None and req.key.limiter.tokens is not None
        counted = limited or self.count_usage
        add_usage = counted and req.inbound.stream and not req.inbound.wants_usage
        fallback = out.fallback_from is not None
        headers = [(k, v) for k, v in req.headers if k not in _HOP_BY_HOP]
        headers.append((b"x-request-id", req.request_id.encode()))
        body = req.inbound.rewritten(
            model=service.model if fallback else None,
            include_usage=add_usage,
            priority=self.cluster.engine_priority(level) if service.priority_scheduling else None,
        )
        attempt = Attempt(
            band=req.band,
            level=level,
            tenant=req.tenant,
            deadline=min(req.deadline, req.arrival + service.timeouts.request_seconds),
            cost=_cost(req.inbound),
            tried=set(),
            sticky=req.inbound.session_key(req.header(b"x-session-id")),
            prefix=affinity_key(req.inbound, service),
            state=state,
            req=req,
            body=body,
            headers=headers,
            add_usage=add_usage,
            count_usage=counted,
        )
        last_error: str = ""
        self.metrics.arrivals(*state.key).inc()
        while True:
            pod = self.cluster.place(state, attempt, loop.time()) or await self.cluster.wait(
                state, attempt, out
            )
            if pod is None:
                break  # every pod tried: answer with the last error
            variant = pod.variant
            attempt.tried.add(pod.id)
            out.attempts += 1
            out.variant, out.pod = variant, pod.id
            if out.attempts > 1:
                self.metrics.retries.labels(*state.key).inc()
            last = out.attempts > service.routing.retries
            result = await self._attempt(attempt, variant, pod, send, out, last)
            if result is None:
                if out.completion_tokens is not None:
                    actual = out.completion_tokens - _output(req.inbound)
                    state.queue.charge(attempt.band, attempt.tenant, actual)
                rate_limited = out.status == 429 and service.breaker.count_rate_limited
                return out.status < 500 and not out.failed and not rate_limited
            last_error = result
            if last or loop.time() >= attempt.deadline:
                break
        raise GatewayError(
            502,
            f"no pod of {state.key[1]} could take the request: {last_error}",
            "upstream_unavailable",
        )

    async def _attempt(
        self, a: Attempt, variant: str, pod: Pod, send: Send, out: Outcome, last: bool
    ) -> str | None:
        """One try at one pod. Returns None once an answer went to the client, or why the
        pod failed while nothing had been sent (the caller may retry elsewhere)."""
        loop = asyncio.get_running_loop()
        ns, name = a.state.key
        req = a.req
        in_flight = self.metrics.in_flight(ns, name, variant)
        in_flight.inc()
        sent_at = loop.time()
        first_deadline = min(a.deadline, sent_at + a.state.service.timeouts.first_token_seconds)
        outcome = "ok"
        response: Response | None = None
        headers = a.headers
        span = None
        if self.tracing is not None and req.span is not None:
            span = self._trace_attempt(self.tracing, req.span, a, pod, variant, out, sent_at)
            headers = [h for h in headers if h[0] not in _TRACE_HEADERS]
            headers += self.tracing.traceparent(span)
        try:
            try:
                response = await self.pool.request(
                    pod.host, pod.port, req.method, req.path, headers, a.body, first_deadline
                )
                if response.status in _RETRY_STATUSES and not last:
                    outcome = "http_5xx"
                    return f"{pod.name} answered {response.status}"
                first = await response.read(first_deadline)
            except UpstreamTimeout:
                waited = loop.time() - sent_at
                if req.deadline <= first_deadline:
                    outcome = "client_deadline"
                    raise GatewayError(
                        504,
                        f"the request's own deadline passed after {waited:.1f} s",
                        "deadline_exceeded",
                    ) from None
                outcome = "timeout"
                raise GatewayError(
                    504,
                    f"{pod.name} sent no first token within {waited:.0f} s",
                    "first_token_timeout",
                ) from None
            except UpstreamError as exc:
                outcome = exc.kind
                return f"{pod.name}: {exc}"
            got_first = loop.time()
            if response.status >= 500:
                outcome = "http_5xx"
            elif response.status >= 400:
                outcome = "http_4xx"
            stream = (response.header(b"content-type") or b"").startswith(b"text/event-stream")
            reply = [(k, v) for k, v in response.headers if k not in _NOT_RETURNED]
            reply += _gateway_headers(req, variant, out)
            if not stream:
                try:
                    rest = await response.read_all(a.deadline)
                except UpstreamTimeout:
                    expired = a.expired()
                    outcome = (
                        "client_deadline" if expired.code == "deadline_exceeded" else "timeout"
                    )
                    raise expired from None
                except UpstreamError as exc:
                    outcome = exc.kind
                    return f"{pod.name}: {exc}"
                payload = (first or b"") + rest
                if a.count_usage:
                    usage_tokens(payload, out)
                if out.captured is not None:
                    out.captured.append(payload)
                reply.append((b"content-length", str(len(payload)).encode()))
            out.status = response.status
            out.started = True
            out.reply_headers = reply
            first_sent = loop.time()
            out.ttfb = first_sent - req.arrival
            out.overhead = (sent_at - req.arrival - out.held_seconds) + (first_sent - got_first)
            await send({"type": "http.response.start", "status": out.status, "headers": reply})
            if not stream:
                await send({"type": "http.response.body", "body": payload})
            else:
                failure = await relay_events(
                    response,
                    first,
                    a.deadline,
                    send,
                    out,
                    expired=a.expired(),
                    strip_usage=a.add_usage,
                    count_usage=a.count_usage,
                )
                if failure is not None:
                    outcome = failure
                    out.failed = failure != "client_deadline"
            return None
        finally:
            if span is not None:
                span.set_attribute("ladle.outcome", outcome)
                if response is not None:
                    span.set_attribute("http.response.status_code", response.status)
                span.end()
            if response is not None:
                response.release()
            in_flight.dec()
            self.metrics.upstream(ns, name, variant, pod.id, outcome).inc()
            now = loop.time()
            self.cluster.answered(a.state, pod, a.level, outcome, now, now - sent_at)

    @staticmethod
    def _trace_attempt(
        tracing: Tracing,
        parent: Span,
        a: Attempt,
        pod: Pod,
        variant: str,
        out: Outcome,
        sent_at: float,
    ) -> Span:
        """The attempt's span, whose context goes to the pod; before the first, the request's
        routing (filters, picking) and the time it was held for a slot."""
        if out.attempts == 1:
            bound = sent_at - out.held_seconds
            tracing.record("gateway.route", a.req.arrival, bound, parent)
            if out.held_seconds > 0:
                tracing.record("gateway.queue", bound, sent_at, parent)
        return tracing.child(
            "upstream",
            sent_at,
            parent,
            {
                "ladle.pod": pod.id,
                "ladle.variant": variant,
                "ladle.attempt": out.attempts,
                "server.address": pod.host,
                "server.port": pod.port,
            },
            client=True,
        )


def _gateway_headers(req: ClientRequest, variant: str, out: Outcome) -> HeaderList:
    headers = [(b"x-request-id", req.request_id.encode()), (b"x-ladle-variant", variant.encode())]
    if out.fallback_from is not None and out.service is not None:
        headers.append((FALLBACK_HEADER.encode(), out.service.name.encode()))
    if out.cache is not None:
        headers.append((b"x-ladle-cache", out.cache.encode()))
    return headers


# Output tokens a request that sets no limit is expected to cost its tenant until its answer
# says how many it took.
_DEFAULT_OUTPUT = 128


def _output(inbound: Inbound) -> int:
    limit = inbound.doc.get("max_completion_tokens", inbound.doc.get("max_tokens"))
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    return _DEFAULT_OUTPUT


def _cost(inbound: Inbound) -> float:
    """The tokens a request is expected to cost its tenant's fair share: its prompt (about four
    bytes of body a token) and the output it may ask for; corrected by the answer's usage when
    the gateway reads it."""
    return len(inbound.body) / 4 + _output(inbound)


def affinity_key(inbound: Inbound, service: Service) -> bytes | None:
    """Which point of the pods' hash ring a request would rather land on. Every request for
    one adapter hashes to the same point, so an adapter stays resident on few pods (a swap
    costs a load) and its prefixes are cached there; the picker's bound on load spills a
    popular one over to the next pods of the ring. The base model's requests go by their
    prompt's prefix, where prefix affinity is on."""
    if inbound.model in service.adapters:
        return b"adapter\0" + inbound.model.encode()
    if service.routing.prefix_affinity:
        return inbound.prefix(service.routing.prefix_chars)
    return None
