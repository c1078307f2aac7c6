"""The data path: one client request through breaker, variant split, pod pick and retries to
a pod, and the answer back to the client as it arrives.

``Router`` holds what the decisions need between requests: per service a circuit breaker, an
outlier detector, a hash ring per variant and the scale-from-zero hold; per pod the requests in
flight. It is rebuilt from each new route table, keeping the state of services that remain.
Everything runs on one event loop, so none of it needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ladle.gateway.breaker import Admission, CircuitBreaker, Transition
from ladle.gateway.cache import Entry, ResponseCache, cache_key, cacheable
from ladle.gateway.context import ClientRequest, HeaderList, Outcome, Send
from ladle.gateway.errors import GatewayError
from ladle.gateway.metrics import GatewayMetrics
from ladle.gateway.outlier import OutlierDetector
from ladle.gateway.picker import Candidate, HashRing, pick
from ladle.gateway.relay import relay_events, usage_tokens
from ladle.gateway.routes import Pod, RouteTable, Service, ServiceKey
from ladle.gateway.scrape import PodLoad
from ladle.gateway.split import choose_variant
from ladle.gateway.upstream import Pool, Response, UpstreamError, UpstreamTimeout
from ladle.words import plural

log = logging.getLogger("ladle.gateway")


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
_RETRY_STATUSES = frozenset({502, 503, 504})
MAX_FALLBACK_HOPS = 3
# The gateway's own answers that mean the service failed (a missing pod is the hold's business).
_BREAKER_FAILURES = frozenset({"first_token_timeout", "request_timeout", "upstream_unavailable"})
# Outcomes of an attempt that say nothing against the pod.
_POD_FINE = frozenset({"ok", "http_4xx", "client_deadline"})


class ServiceState:
    """The live routing state of one InferenceService."""

    def __init__(self, service: Service, now: float) -> None:
        self.service = service
        self.breaker = CircuitBreaker(service.breaker, now)
        self.outlier = OutlierDetector(service.outlier)
        self.ready: dict[str, list[Pod]] = {}
        self.rings: dict[str, HashRing] = {}
        self.pod_count = 0
        self.ready_event = asyncio.Event()
        self.held = 0
        self.held_since: float | None = None

    @property
    def key(self) -> ServiceKey:
        return self.service.key

    def configure(self, service: Service, now: float) -> None:
        old = self.service
        self.service = service
        if service.breaker != old.breaker:
            self.breaker = CircuitBreaker(service.breaker, now)
        if service.outlier != old.outlier:
            self.outlier = OutlierDetector(service.outlier)

    def set_pods(self, ready: dict[str, list[Pod]], all_pods: set[str]) -> None:
        self.ready = ready
        self.pod_count = sum(len(p) for p in ready.values())
        for variant, pods in ready.items():
            names = [p.id for p in pods]
            ring = self.rings.get(variant)
            if ring is None or ring.pods != frozenset(names):
                self.rings[variant] = HashRing(names)
        for variant in self.rings.keys() - ready.keys():
            del self.rings[variant]
        self.outlier.retain(all_pods)
        if self.pod_count:
            self.ready_event.set()
        else:
            self.ready_event.clear()


@dataclass
class Hooks:
    """Where breaker transitions and hold episodes are reported (status writer, logs)."""

    on_transition: Callable[[ServiceState, Transition], None] = lambda st, t: None
    on_hold: Callable[[ServiceState], None] = lambda st: None
    on_new: Callable[[ServiceState], None] = lambda st: None
    on_table: Callable[[RouteTable, Mapping[ServiceKey, ServiceState]], None] = lambda t, s: None


@dataclass
class Router:
    metrics: GatewayMetrics
    pool: Pool
    max_held: int = 256
    hooks: Hooks = field(default_factory=Hooks)
    loads: Callable[[], dict[str, PodLoad]] = dict
    # Read every response's usage (the audit trail's token counts), not only limited keys'.
    count_usage: bool = False
    cache: ResponseCache | None = None
    rng: random.Random = field(default_factory=random.Random)
    table: RouteTable = field(default_factory=RouteTable)
    states: dict[ServiceKey, ServiceState] = field(default_factory=dict)
    outstanding: dict[str, int] = field(default_factory=dict)

    # -- table updates and time ----------------------------------------------------------

    def update(self, table: RouteTable, now: float) -> None:
        old_pods = {
            p for variants in self.table.pods.values() for ps in variants.values() for p in ps
        }
        self.table = table
        for key in self.states.keys() - table.services.keys():
            self.states.pop(key)
            self.metrics.forget_service(*key)
        for key, service in table.services.items():
            state = self.states.get(key)
            if state is None:
                state = self.states[key] = ServiceState(service, now)
                self.metrics.breaker(*key, state.breaker.state)
                self.hooks.on_new(state)
            else:
                state.configure(service, now)
            all_pods = {p.id for ps in table.pods.get(key, {}).values() for p in ps}
            state.set_pods(table.ready_pods(key), all_pods)
        self.hooks.on_table(table, self.states)
        new_pods = {p for variants in table.pods.values() for ps in variants.values() for p in ps}
        addresses = {(p.host, p.port) for p in new_pods}
        ids = {p.id for p in new_pods}
        for gone in old_pods - new_pods:
            if (gone.host, gone.port) not in addresses:
                self.pool.drop(gone.host, gone.port)
            if gone.id not in ids:
                self.metrics.forget_pod(gone.id)
        self.tick(now)

    def tick(self, now: float) -> None:
        """Time-driven breaker transitions; called every second and after each update."""
        for state in self.states.values():
            expected = state.service.replicas > 0
            transition = state.breaker.observe_ready(now, state.pod_count, expected)
            if transition is not None:
                self._transitioned(state, transition)
            self.metrics.ejected.labels(*state.key).set(len(state.outlier.ejected(now)))

    def _transitioned(self, state: ServiceState, transition: Transition) -> None:
        ns, name = state.key
        self.metrics.breaker(ns, name, transition.new)
        self.metrics.breaker_transitions.labels(ns, name, transition.new.value).inc()
        log.warning(
            "circuit breaker %s",
            transition.new.value.lower(),
            extra={
                "namespace": ns,
                "service": name,
                "from": transition.old.value,
                "to": transition.new.value,
                "reason": transition.reason,
                "fallback": state.service.fallback,
            },
        )
        self.hooks.on_transition(state, transition)

    def models(self) -> list[Service]:
        return sorted(self.table.by_model.values(), key=lambda s: s.model)

    # -- one request ---------------------------------------------------------------------

    async def handle(self, req: ClientRequest, send: Send, out: Outcome) -> None:
        """Serve ``req``; raises GatewayError for an answer the gateway gives itself."""
        loop = asyncio.get_running_loop()
        owner = self.table.by_model.get(req.inbound.model)
        if owner is None:
            self.metrics.rejected.labels("", "", "unknown_model").inc()
            raise GatewayError(
                404,
                f"the model {req.inbound.model!r} does not exist; GET /v1/models lists the "
                "models this gateway routes",
                "model_not_found",
                param="model",
            )
        key = self._cache_key(owner, req)
        if key is not None and await self._from_cache(key, owner, req, send, out):
            return
        state = self.states[owner.key]
        visited: list[ServiceState] = []
        while True:
            now = loop.time()
            transition = state.breaker.tick(now)  # open → half-open happens as time passes
            if transition is not None:
                self._transitioned(state, transition)
            admission = state.breaker.allow(now)
            if admission is not Admission.REJECT:
                break
            fallback = state.service.fallback
            nxt = self.states.get((state.key[0], fallback)) if fallback else None
            if nxt is None or nxt in visited or nxt is state or len(visited) >= MAX_FALLBACK_HOPS:
                self.metrics.rejected.labels(*state.key, "breaker_open").inc()
                # Counted under the service that refused it: the availability SLO must see it.
                out.service = state.service
                wait = state.service.breaker.open_seconds - (loop.time() - state.breaker.since)
                retry = max(1, math.ceil(wait))
                raise GatewayError(
                    503,
                    f"{state.key[1]} is unavailable: its circuit breaker is open "
                    f"({state.breaker.reason}); retry in {retry} s",
                    "circuit_open",
                    headers=[(b"retry-after", str(retry).encode())],
                )
            self.metrics.fallbacks.labels(*state.key, nxt.key[1]).inc()
            visited.append(state)
            state = nxt
        out.service = state.service
        if visited:
            out.fallback_from = visited[0].key[1]
        probe = admission is Admission.PROBE
        success: bool | None = None
        try:
            success = await self._serve(state, req, send, out, bool(visited))
            if key is not None and success and not visited:
                self._store(key, req, out)
        except GatewayError as exc:
            if exc.code in _BREAKER_FAILURES:
                success = False
            raise
        finally:
            if success is None:
                if probe:
                    state.breaker.release_probe()
            else:
                transition = state.breaker.record(loop.time(), success, probe=probe)
                if transition is not None:
                    self._transitioned(state, transition)

    # -- the response cache --------------------------------------------------------------

    def _cache_key(self, service: Service, req: ClientRequest) -> bytes | None:
        """The request's key, if the service caches and the answer is deterministic."""
        if self.cache is None or not service.response_cache or not cacheable(req.inbound.doc):
            return None
        live = [variant for variant, weight in service.weights if weight > 0]
        if len(live) != 1:
            return None  # a canary split: which variant will answer is not known yet
        revision = service.revision(live[0])
        if revision is None:
            return None  # its pods are changing revision, or none has been reported yet
        scope = req.key.cache_scope if req.key is not None else ""
        return cache_key(service.key, revision, live[0], scope, req.path, req.inbound.doc)

    async def _from_cache(
        self, key: bytes, service: Service, req: ClientRequest, send: Send, out: Outcome
    ) -> bool:
        assert self.cache is not None
        entry = self.cache.get(key)
        out.cache = "miss" if entry is None else "hit"
        self.metrics.cache(*service.key, out.cache).inc()
        if entry is None:
            if out.captured is None:
                out.captured = []
            return False
        out.service, out.status, out.started = service, entry.status, True
        out.ttfb = asyncio.get_running_loop().time() - req.arrival
        headers = [*entry.headers, (b"x-request-id", req.request_id.encode())]
        headers.append((b"x-ladle-cache", b"hit"))
        await send({"type": "http.response.start", "status": entry.status, "headers": headers})
        await send({"type": "http.response.body", "body": entry.body})
        return True

    def _store(self, key: bytes, req: ClientRequest, out: Outcome) -> None:
        """Keep a complete 200 answer; a failed, cut or fallback answer is never kept."""
        assert self.cache is not None
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

    async def _serve(
        self, state: ServiceState, req: ClientRequest, send: Send, out: Outcome, fallback: bool
    ) -> bool:
        """Run the attempts; True when the service did its job (for the breaker)."""
        loop = asyncio.get_running_loop()
        service = state.service
        deadline = min(req.deadline, req.arrival + service.timeouts.request_seconds)
        limited = req.key is not None and req.key.limiter.tokens is not None
        counted = limited or self.count_usage
        add_usage = counted and req.inbound.stream and not req.inbound.wants_usage
        body = req.inbound.rewritten(
            model=service.model if fallback else None, include_usage=add_usage
        )
        headers = [(k, v) for k, v in req.headers if k not in _HOP_BY_HOP]
        headers.append((b"x-request-id", req.request_id.encode()))
        sticky = req.inbound.session_key(req.session_header)
        prefix = (
            req.inbound.prefix(service.routing.prefix_chars)
            if service.routing.prefix_affinity
            else None
        )
        tried: set[str] = set()
        hold_until: float | None = None
        last_error: str = ""
        retries = service.routing.retries
        while True:
            choice = self._choose(state, tried, sticky, prefix, loop.time())
            if choice is None:
                if tried:
                    break  # every pod tried: answer with the last error
                if hold_until is None:
                    hold_until = min(
                        deadline, loop.time() + service.timeouts.scale_from_zero_seconds
                    )
                await self._hold(state, hold_until, out)
                continue
            variant, pod = choice
            tried.add(pod.id)
            out.attempts += 1
            out.variant, out.pod = variant, pod.id
            if out.attempts > 1:
                self.metrics.retries.labels(*state.key).inc()
            last_attempt = out.attempts > retries
            result = await self._attempt(
                state,
                variant,
                pod,
                req,
                body,
                headers,
                deadline,
                send,
                out,
                last_attempt,
                add_usage,
                counted,
            )
            if result is None:
                rate_limited = out.status == 429 and service.count_rate_limited
                return out.status < 500 and not out.failed and not rate_limited
            last_error = result
            if last_attempt or loop.time() >= deadline:
                break
        raise GatewayError(
            502,
            f"no pod of {state.key[1]} could take the request: {last_error}",
            "upstream_unavailable",
        )

    def _choose(
        self,
        state: ServiceState,
        tried: set[str],
        sticky: bytes | None,
        prefix: bytes | None,
        now: float,
    ) -> tuple[str, Pod] | None:
        excluded = state.outlier.ejected(now) | tried if tried else state.outlier.ejected(now)
        usable = (
            {v: [p for p in pods if p.id not in excluded] for v, pods in state.ready.items()}
            if excluded
            else state.ready
        )
        available = {v for v, pods in usable.items() if pods}
        variant = choose_variant(state.service.weights, available, rng=self.rng, sticky=sticky)
        if variant is None:
            return None
        loads = self.loads()
        candidates = []
        by_id = {}
        for pod in usable[variant]:
            load = loads.get(pod.id)
            candidates.append(
                Candidate(
                    pod.id,
                    self.outstanding.get(pod.id, 0),
                    None if load is None else load.waiting,
                    None if load is None else load.kv_usage,
                )
            )
            by_id[pod.id] = pod
        chosen = pick(
            candidates,
            rng=self.rng,
            key=prefix,
            ring=state.rings.get(variant),
            load_factor=state.service.routing.load_factor,
        )
        return None if chosen is None else (variant, by_id[chosen.name])

    async def _hold(self, state: ServiceState, until: float, out: Outcome) -> None:
        """Wait for a ready pod (scale from zero), in a bounded queue."""
        loop = asyncio.get_running_loop()
        ns, name = state.key
        if state.held >= self.max_held:
            self.metrics.rejected.labels(ns, name, "hold_queue_full").inc()
            raise GatewayError(
                503,
                f"{name} has no ready pod and "
                f"{plural(state.held, 'request already waits', 'requests already wait')} for one",
                "no_ready_pods",
                headers=[(b"retry-after", b"5")],
            )
        started = loop.time()
        state.held += 1
        self.metrics.held.labels(ns, name).set(state.held)
        self.metrics.held_total.labels(ns, name).inc()
        if state.held_since is None:
            state.held_since = started
            self.hooks.on_hold(state)
        try:
            await asyncio.wait_for(state.ready_event.wait(), max(0.0, until - started))
        except TimeoutError:
            self.metrics.rejected.labels(ns, name, "hold_timeout").inc()
            raise GatewayError(
                503,
                f"{name} has no ready pod; waited {loop.time() - started:.0f} s for one",
                "no_ready_pods",
                headers=[(b"retry-after", b"5")],
            ) from None
        finally:
            out.held_seconds += loop.time() - started
            state.held -= 1
            self.metrics.held.labels(ns, name).set(state.held)
            if state.held == 0:
                state.held_since = None
                self.hooks.on_hold(state)

    async def _attempt(
        self,
        state: ServiceState,
        variant: str,
        pod: Pod,
        req: ClientRequest,
        body: bytes,
        headers: HeaderList,
        deadline: float,
        send: Send,
        out: Outcome,
        last: bool,
        add_usage: bool,
        count_usage: bool,
    ) -> str | None:
        """One try at one pod. Returns None once an answer went to the client, or why the
        pod failed while nothing had been sent (the caller may retry elsewhere)."""
        loop = asyncio.get_running_loop()
        ns, name = state.key
        timeouts = state.service.timeouts
        in_flight = self.metrics.in_flight(ns, name, variant)
        self.outstanding[pod.id] = self.outstanding.get(pod.id, 0) + 1
        in_flight.inc()
        sent_at = loop.time()
        first_deadline = min(deadline, sent_at + timeouts.first_token_seconds)
        outcome = "ok"
        response: Response | None = None
        try:
            try:
                response = await self.pool.request(
                    pod.host, pod.port, req.method, req.path, headers, body, first_deadline
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
                    rest = await response.read_all(deadline)
                except UpstreamTimeout:
                    expired = _expired(req, deadline)
                    outcome = (
                        "client_deadline" if expired.code == "deadline_exceeded" else "timeout"
                    )
                    raise expired from None
                except UpstreamError as exc:
                    outcome = exc.kind
                    return f"{pod.name}: {exc}"
                payload = (first or b"") + rest
                if count_usage:
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
                    deadline,
                    send,
                    out,
                    expired=_expired(req, deadline),
                    strip_usage=add_usage,
                    count_usage=count_usage,
                )
                if failure is not None:
                    outcome = failure
                    out.failed = failure != "client_deadline"
            return None
        finally:
            if response is not None:
                response.release()
            self.outstanding[pod.id] -= 1
            if not self.outstanding[pod.id]:
                del self.outstanding[pod.id]
            in_flight.dec()
            self.metrics.upstream(ns, name, variant, pod.id, outcome).inc()
            error = outcome not in _POD_FINE
            ejection = state.outlier.record(pod.id, loop.time(), error, state.pod_count)
            if ejection is not None:
                self.metrics.ejections.labels(ns, name, pod.id).inc()
                self.metrics.ejected.labels(ns, name).set(len(state.outlier.ejected(loop.time())))
                log.warning(
                    "pod ejected",
                    extra={
                        "namespace": ns,
                        "service": name,
                        "pod": pod.id,
                        "seconds": ejection.seconds,
                        "times": ejection.times,
                    },
                )


def _expired(req: ClientRequest, deadline: float) -> GatewayError:
    """The answer when ``deadline`` passes: the client's own (not the service's fault) or the
    service's ``timeouts.requestSeconds`` (a breaker failure)."""
    if req.deadline <= deadline:
        return GatewayError(504, "the request's own deadline passed", "deadline_exceeded")
    return GatewayError(504, "the service's request timeout passed", "request_timeout")


def _gateway_headers(req: ClientRequest, variant: str, out: Outcome) -> HeaderList:
    headers = [(b"x-request-id", req.request_id.encode()), (b"x-ladle-variant", variant.encode())]
    if out.fallback_from is not None and out.service is not None:
        headers.append((b"x-ladle-fallback", out.service.name.encode()))
    if out.cache is not None:
        headers.append((b"x-ladle-cache", out.cache.encode()))
    return headers
