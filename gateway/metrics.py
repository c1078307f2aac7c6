"""The gateway's Prometheus metrics, per service, variant and pod, under ``ladle_gateway_``.

Label children are looked up once per service and pod and kept, since ``labels()`` on every
request would cost more than the rest of the bookkeeping together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from ladle.gateway.breaker import State

M = TypeVar("M", bound=MetricWrapperBase)


class Series(Generic[M]):
    """A labelled metric whose children are looked up once and kept: ``labels()`` takes a
    lock and builds a key on every call, which the data path cannot afford per request."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> M:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self.metric.labels(*labels)
        return child

    def forget(self, match: Callable[[tuple[str, ...]], bool]) -> None:
        for labels in [k for k in self._children if match(k)]:
            del self._children[labels]
            with contextlib.suppress(KeyError):
                self.metric.remove(*labels)


# Why the flow queue gave up on a request (ladle_gateway_shed_total's reason).
SHED_REASONS = ("queue_full", "displaced", "deadline", "no_ready_pods")
# The gateway's own added latency is sub-millisecond; the buckets resolve 100 µs to 100 ms.
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)
        svc = ["namespace", "service"]
        self.requests_metric = Counter(
            "ladle_gateway_requests",
            "Requests answered, by the service and variant that served them and HTTP status.",
            [*svc, "variant", "code"],
            registry=r,
        )
        self.upstream_metric = Counter(
            "ladle_gateway_upstream_requests",
            "Attempts sent to pods, by outcome (ok, http_4xx, http_5xx, connect_error, reset, "
            "timeout).",
            [*svc, "variant", "pod", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "ladle_gateway_retries", "Attempts retried on another pod.", svc, registry=r
        )
        self.in_flight_metric = Gauge(
            "ladle_gateway_in_flight_requests",
            "Requests in flight to the service's pods.",
            [*svc, "variant"],
            registry=r,
        )
        self.ejections = Counter(
            "ladle_gateway_ejections", "Pods ejected as outliers.", [*svc, "pod"], registry=r
        )
        self.ejected = Gauge(
            "ladle_gateway_ejected_pods", "Pods out of rotation now.", svc, registry=r
        )
        self.breaker_state = Gauge(
            "ladle_gateway_breaker_state",
            "1 for the circuit breaker's current state (Closed, Open, HalfOpen), else 0.",
            [*svc, "state"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "ladle_gateway_breaker_transitions",
            "Circuit breaker transitions, by the state entered.",
            [*svc, "state"],
            registry=r,
        )
        self.fallbacks = Counter(
            "ladle_gateway_fallbacks",
            "Requests sent to the fallback service while the breaker was open.",
            [*svc, "fallback"],
            registry=r,
        )
        self.rejected = Counter(
            "ladle_gateway_rejected",
            "Requests refused before reaching a pod, by reason (breaker_open, unknown_model, "
            "...); the queue's refusals are ladle_gateway_shed_total.",
            [*svc, "reason"],
            registry=r,
        )
        self.arrivals_metric = Counter(
            "ladle_gateway_arrivals",
            "Requests that asked the service's pods for a slot (bound at once or held; a cached "
            "answer or a refusal at the door is not one): the autoscaler's arrival rate.",
            svc,
            registry=r,
        )
        queue = [*svc, "band"]
        self.held_metric = Gauge(
            "ladle_gateway_held_requests",
            "Requests waiting at the gateway for a pod's free slot, or for a ready pod at zero, "
            "by priority band; the autoscaler reads their sum as demand.",
            queue,
            registry=r,
        )
        self.queued_metric = Counter(
            "ladle_gateway_queued",
            "Requests that had to wait for a slot, by band and tenant.",
            [*queue, "tenant"],
            registry=r,
        )
        self.tenant_wait_metric = Counter(
            "ladle_gateway_queue_tenant_wait_seconds",
            "Seconds waited in the queue, by band and tenant (over ladle_gateway_queued_total: "
            "each tenant's mean wait).",
            [*queue, "tenant"],
            registry=r,
        )
        self.queue_wait_metric = Histogram(
            "ladle_gateway_queue_wait_seconds",
            "Time a request waited in the queue for a slot, by band.",
            queue,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.shed_metric = Counter(
            "ladle_gateway_shed",
            "Requests the queue gave up on, by band and reason: queue_full (429 on arrival), "
            "displaced (429, made room for a higher band), deadline (504), no_ready_pods (503).",
            [*queue, "reason"],
            registry=r,
        )
        self.rate_limited = Counter(
            "ladle_gateway_rate_limited",
            "Requests refused with 429 by an API key's limit (requests or tokens).",
            ["key", "limit"],
            registry=r,
        )
        self.overhead_metric = Histogram(
            "ladle_gateway_added_latency_seconds",
            "Time the gateway adds to a request: arrival to the pod request, plus the pod's "
            "first byte to the client's.",
            svc,
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.duration_metric = Histogram(
            "ladle_gateway_request_duration_seconds",
            "Arrival to the last byte sent.",
            svc,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb_metric = Histogram(
            "ladle_gateway_time_to_first_byte_seconds",
            "Arrival to the first response byte sent (the first token of a stream).",
            svc,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.cache_metric = Counter(
            "ladle_gateway_response_cache_requests",
            "Cacheable requests to services with spec.responseCache, by result (hit, miss).",
            [*svc, "result"],
            registry=r,
        )
        self.cache_bytes = Gauge(
            "ladle_gateway_response_cache_bytes", "Bytes the response cache holds.", registry=r
        )
        self.cache_entries = Gauge(
            "ladle_gateway_response_cache_entries", "Responses the cache holds.", registry=r
        )
        self.cache_evictions = Counter(
            "ladle_gateway_response_cache_evictions",
            "Responses dropped to keep the cache within --response-cache-size.",
            registry=r,
        )

        # The per-request series, with their children kept.
        self.cache = Series(self.cache_metric)
        self.requests = Series(self.requests_metric)
        self.upstream = Series(self.upstream_metric)
        self.in_flight = Series(self.in_flight_metric)
        self.overhead = Series(self.overhead_metric)
        self.duration = Series(self.duration_metric)
        self.ttfb = Series(self.ttfb_metric)
        self.held = Series(self.held_metric)
        self.arrivals = Series(self.arrivals_metric)
        self.queued = Series(self.queued_metric)
        self.tenant_wait = Series(self.tenant_wait_metric)
        self.queue_wait = Series(self.queue_wait_metric)
        self.shed = Series(self.shed_metric)

    def slot_times(self, read: Callable[[], Iterable[tuple[str, str, float]]]) -> None:
        """Export ``ladle_gateway_slot_seconds`` from ``read`` ((namespace, service, seconds)
        for each service that has timed a request) at scrape time: a gauge set as each request
        ends would cost the data path a lock."""
        self.registry.register(_SlotTimes(read))

    def breaker(self, namespace: str, service: str, state: State) -> None:
        for s in State:
            self.breaker_state.labels(namespace, service, s.value).set(1 if s is state else 0)

    def new_service(self, namespace: str, service: str, bands: tuple[str, ...]) -> None:
        """Start a service's queue series at zero, so that a queue never used reads 0 rather
        than nothing (a rate over a counter that does not exist yet is no data, not 0)."""
        self.arrivals(namespace, service)
        for band in bands:
            self.held(namespace, service, band).set(0)
            for reason in SHED_REASONS:
                self.shed(namespace, service, band, reason)

    def forget_service(self, namespace: str, service: str) -> None:
        """Drop a deleted service's series, so that they do not report it forever."""
        for s in State:
            _remove(self.breaker_state, namespace, service, s.value)
        _remove(self.ejected, namespace, service)
        for series in (
            self.in_flight,
            self.cache,
            self.held,
            self.arrivals,
            self.queued,
            self.tenant_wait,
            self.queue_wait,
            self.shed,
        ):
            series.forget(lambda labels: labels[:2] == (namespace, service))

    def forget_pod(self, pod: str) -> None:
        """Drop the series of a pod that is gone; pods come and go with every rollout."""
        self.upstream.forget(lambda labels: labels[3] == pod)


def _remove(metric: Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


class TenantLabels:
    """A tenant's label value: its own name for the first ``limit`` tenants seen, ``other``
    after them, so that clients inventing fairness ids cannot grow the series without bound."""

    def __init__(self, limit: int = 100) -> None:
        self.limit = limit
        self._known: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        if len(self._known) < self.limit:
            self._known.add(tenant)
            return tenant
        return "other"


class _SlotTimes(Collector):
    def __init__(self, read: Callable[[], Iterable[tuple[str, str, float]]]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "ladle_gateway_slot_seconds",
            "The mean time a request has lately held a pod's slot (a moving average, once one "
            "has finished); the autoscaler turns the held requests into demand with it.",
            labels=["namespace", "service"],
        )
        for namespace, service, seconds in self.read():
            family.add_metric([namespace, service], seconds)
        yield family
