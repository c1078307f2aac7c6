"""How the gateway treats a service's traffic: routing, the circuit breaker and its fallback,
outlier detection, timeouts and the response cache (``spec.routing``, ``spec.circuitBreaker``,
``spec.fallback``, ``spec.timeouts``, ``spec.responseCache``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RoutingPolicy:
    prefix_affinity: bool = True
    prefix_chars: int = 100
    load_factor: float = 1.25
    retries: int = 2
    # Requests one pod takes from the gateway at a time (None: the engine's maxNumSeqs; 0: no
    # limit, every request is sent on arrival).
    max_concurrency: int | None = None


@dataclass(frozen=True)
class BreakerConfig:
    enabled: bool = True
    failure_rate: float = 0.5  # trip at or above this share of failed calls
    window_seconds: int = 30
    minimum_calls: int = 20
    open_seconds: float = 30.0
    half_open_probes: int = 3
    no_ready_seconds: float = 30.0
    # A pod's 429 counts as a failure (its queue is full) instead of as an answer.
    count_rate_limited: bool = False


@dataclass(frozen=True)
class OutlierConfig:
    consecutive_errors: int = 5
    interval_seconds: float = 10.0
    base_ejection_seconds: float = 30.0
    max_ejection_percent: int = 10


@dataclass(frozen=True)
class Timeouts:
    request_seconds: float = 600.0
    first_token_seconds: float = 60.0
    scale_from_zero_seconds: float = 120.0


@dataclass(frozen=True)
class TrafficSpec:
    fallback: str | None = None
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    response_cache: bool = False


def parse_traffic(spec: Mapping[str, Any]) -> TrafficSpec:
    routing = spec.get("routing") or {}
    outlier = routing.get("outlierDetection") or {}
    breaker = spec.get("circuitBreaker") or {}
    timeouts = spec.get("timeouts") or {}
    r, b, o, t = RoutingPolicy(), BreakerConfig(), OutlierConfig(), Timeouts()
    return TrafficSpec(
        fallback=spec.get("fallback") or None,
        routing=RoutingPolicy(
            prefix_affinity=bool(routing.get("prefixAffinity", r.prefix_affinity)),
            prefix_chars=int(routing.get("prefixChars", r.prefix_chars)),
            load_factor=int(routing.get("loadFactorPercent", r.load_factor * 100)) / 100.0,
            retries=int(routing.get("retries", r.retries)),
            max_concurrency=(
                None if routing.get("maxConcurrency") is None else int(routing["maxConcurrency"])
            ),
        ),
        breaker=BreakerConfig(
            enabled=bool(breaker.get("enabled", b.enabled)),
            failure_rate=int(breaker.get("failureRatePercent", b.failure_rate * 100)) / 100.0,
            window_seconds=int(breaker.get("windowSeconds", b.window_seconds)),
            minimum_calls=int(breaker.get("minimumCalls", b.minimum_calls)),
            open_seconds=int(breaker.get("openSeconds", b.open_seconds)),
            half_open_probes=int(breaker.get("halfOpenProbes", b.half_open_probes)),
            no_ready_seconds=int(breaker.get("noReadyPodsSeconds", b.no_ready_seconds)),
            count_rate_limited=bool(breaker.get("countRateLimited", b.count_rate_limited)),
        ),
        outlier=OutlierConfig(
            consecutive_errors=int(outlier.get("consecutiveErrors", o.consecutive_errors)),
            interval_seconds=int(outlier.get("intervalSeconds", o.interval_seconds)),
            base_ejection_seconds=int(outlier.get("baseEjectionSeconds", o.base_ejection_seconds)),
            max_ejection_percent=int(outlier.get("maxEjectionPercent", o.max_ejection_percent)),
        ),
        timeouts=Timeouts(
            request_seconds=int(timeouts.get("requestSeconds", t.request_seconds)),
            first_token_seconds=int(timeouts.get("firstTokenSeconds", t.first_token_seconds)),
            scale_from_zero_seconds=int(
                timeouts.get("scaleFromZeroSeconds", t.scale_from_zero_seconds)
            ),
        ),
        response_cache=bool((spec.get("responseCache") or {}).get("enabled", False)),
    )
