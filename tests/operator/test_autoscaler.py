"""The autoscaler's edges without a cluster: reading /metrics, and the status it writes."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from ladle.api import parse_isvc
from ladle.gateway.metrics import GatewayMetrics
from ladle.operator.autoscaler import autoscaling_status, policy_for
from ladle.operator.load import GatewayLoad
from ladle.operator.scaling import (
    METRICS_UNAVAILABLE,
    PANIC,
    Decision,
)
from ladle.operator.scrape import gateway_metrics, parse_gateway, parse_pod


def runtime_exposition(
    running: float, waiting: float, kv: float, gaps: tuple[float, ...] | None = None
) -> str:
    """What a runtime pod's /metrics holds, rendered by prometheus_client as the server does;
    ``gaps`` are the inter-token latencies it observed (None: an exposition without them)."""
    registry = CollectorRegistry()
    for name, value in (
        ("ladle:num_requests_running", running),
        ("ladle:num_requests_waiting", waiting),
        ("ladle:kv_cache_usage_perc", kv),
    ):
        Gauge(name, name, ["model_name"], registry=registry).labels("m").set(value)
    if gaps is not None:
        itl = Histogram("ladle:inter_token_latency_seconds", "x", ["model_name"], registry=registry)
        for gap in gaps:
            itl.labels("m").observe(gap)
    return generate_latest(registry).decode()


def gateway_exposition(rows: list[tuple[str, str, str, float, float]]) -> str:
    registry = CollectorRegistry()
    flight = Gauge(
        "ladle_gateway_in_flight_requests",
        "x",
        ["namespace", "service", "variant"],
        registry=registry,
    )
    held = Gauge("ladle_gateway_held_requests", "x", ["namespace", "service"], registry=registry)
    for namespace, service, variant, in_flight, waiting in rows:
        flight.labels(namespace, service, variant).set(in_flight)
        held.labels(namespace, service).set(waiting)
    return generate_latest(registry).decode()


def test_a_pods_gauges_are_read_and_a_missing_one_is_an_error_not_zero() -> None:
    pod = parse_pod("p", runtime_exposition(3, 2, 0.25))
    assert (pod.running, pod.waiting, pod.kv_usage, pod.error) == (3, 2, 0.25, None)
    broken = parse_pod("p", "# nothing here\n")
    assert broken.error is not None
    assert "ladle:kv_cache_usage_perc" in broken.error
    assert parse_pod("p", "garbage{").error is not None


def test_a_pods_inter_token_totals_are_read_for_the_pace_and_optional() -> None:
    pod = parse_pod("p", runtime_exposition(3, 0, 0.1, gaps=(0.25, 0.5, 0.25)))
    assert (pod.itl_sum, pod.itl_count, pod.error) == (1.0, 3.0, None)
    without = parse_pod("p", runtime_exposition(3, 0, 0.1))
    assert (without.itl_sum, without.itl_count, without.error) == (None, None, None)


def test_gateway_counts_sum_variants_and_replicas_for_one_service() -> None:
    one = gateway_exposition([("ns", "chat", "stable", 3, 1), ("ns", "chat", "canary", 2, 1)])
    other = gateway_exposition([("ns", "chat", "stable", 4, 0), ("ns", "other", "stable", 9, 9)])
    read = parse_gateway(one, "ns", "chat", "gw-a")
    assert read == GatewayLoad(in_flight=5, held=1, arrivals={"gw-a": 0})
    summed = gateway_metrics({"gw-a": one, "gw-b": other}, "ns", "chat")
    assert summed is not None
    assert (summed.in_flight, summed.held, summed.error) == (9, 1, None)


def test_the_gateways_own_page_gives_the_held_requests_and_the_mean_slot_time() -> None:
    """Read from what the gateway's own metrics write: held requests by band, and the slot
    time once a request has been timed (a gateway that has timed none does not count)."""
    timed, fresh = GatewayMetrics(), GatewayMetrics()
    for gateway in (timed, fresh):
        gateway.new_service("ns", "chat", ("critical", "standard"))
        gateway.held("ns", "chat", "critical").set(2)
        gateway.held("ns", "chat", "standard").set(5)
        gateway.in_flight("ns", "chat", "stable").set(8)
    timed.slot_times(lambda: [("ns", "chat", 3.5), ("ns", "other", 60.0)])
    timed.arrivals("ns", "chat").inc(20)
    fresh.arrivals("ns", "chat").inc(3)
    pages = {name: generate_latest(g.registry).decode() for name, g in (("a", timed), ("b", fresh))}
    assert parse_gateway(pages["a"], "ns", "chat", "a") == GatewayLoad(8, 7, None, 3.5, {"a": 20})
    assert parse_gateway(pages["b"], "ns", "chat", "b") == GatewayLoad(8, 7, None, None, {"b": 3})
    summed = gateway_metrics(pages, "ns", "chat")
    arrivals = {"a": 20, "b": 3}  # by replica: each one's counter restarts on its own
    assert summed == GatewayLoad(in_flight=16, held=14, slot_seconds=3.5, arrivals=arrivals)


def test_an_unreachable_gateway_is_unknown_data_and_none_configured_is_no_data() -> None:
    failed = gateway_metrics({"gw-a": TimeoutError()}, "ns", "chat")
    assert failed is not None
    assert failed.error == "gateway gw-a: no answer within 1 s"
    assert gateway_metrics({}, "ns", "chat") is None


def isvc(**spec: Any) -> Any:
    return parse_isvc(
        {
            "metadata": {"name": "chat", "namespace": "ns", "uid": "u", "generation": 3},
            "spec": {"model": {"name": "m"}, "replicas": 2, "minReplicas": 1, **spec},
        }
    )


def test_the_policy_comes_from_the_spec_with_defaults() -> None:
    policy = policy_for(isvc(maxReplicas=5, autoscaling={"panicThresholdPercent": 300}))
    assert (policy.min_replicas, policy.max_replicas) == (1, 5)
    assert policy.target_concurrency == 16
    assert policy.panic_threshold == 3.0
    kv_only = policy_for(isvc(maxReplicas=5, autoscaling={"targetKVCacheUsage": 0.6}))
    assert (kv_only.target_concurrency, kv_only.target_kv_usage) == (None, 0.6)


def test_requested_replicas_follow_the_decision_in_status_within_the_bounds() -> None:
    service = isvc(maxReplicas=4, autoscaling={})
    assert service.requested_replicas == 2  # spec.replicas until a decision exists
    decided = parse_isvc(
        {
            "metadata": {"name": "chat", "namespace": "ns"},
            "spec": {"model": {"name": "m"}, "replicas": 2, "maxReplicas": 4, "autoscaling": {}},
            "status": {"autoscaling": {"desiredReplicas": 9}},
        }
    )
    assert decided.requested_replicas == 4
    assert isvc(replicas=3).requested_replicas == 3  # no autoscaling: spec.replicas


def test_status_carries_the_decision_and_hpa_style_conditions() -> None:
    service = isvc(maxReplicas=3, autoscaling={})
    panic = Decision(3, PANIC, "panic window demand 80.0", panicking=True, wanted=5)
    status = autoscaling_status(service, panic, {}, "2026-11-30T10:00:00Z", "T")
    assert status["autoscaling"]["desiredReplicas"] == 3
    assert status["autoscaling"]["lastScaleTime"] == "2026-11-30T10:00:00Z"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["ScalingActive"]["status"] == "True"
    assert conditions["ScalingActive"]["reason"] == PANIC
    assert conditions["ScalingLimited"]["reason"] == "TooManyReplicas"
    assert "asks for 5 replicas; maxReplicas is 3" in conditions["ScalingLimited"]["message"]
    assert conditions["ScalingActive"]["observedGeneration"] == 3

    frozen = Decision(3, METRICS_UNAVAILABLE, "pod p: connection refused", frozen=True, wanted=3)
    later = autoscaling_status(service, frozen, status, None, "T2")
    active = {c["type"]: c for c in later["conditions"]}["ScalingActive"]
    assert (active["status"], active["reason"]) == ("False", METRICS_UNAVAILABLE)
    assert active["message"] == "pod p: connection refused"
    assert active["lastTransitionTime"] == "T2"
    assert later["autoscaling"]["metricsFrozen"] is True
