"""InferenceServices and Pods → route table, and the cluster's pod choice over it (pure)."""

from __future__ import annotations

import math
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.gateway.cluster import Ask, Cluster
from ladle.gateway.metrics import GatewayMetrics
from ladle.gateway.routes import Pod, build_table, parse_pod, parse_service
from ladle.gateway.status import conflict_condition
from ladle.gateway.upstream import Pool


def isvc(
    name: str, model: str, *, created: str = "2026-01-01T00:00:00Z", **spec: Any
) -> dict[str, Any]:
    status = spec.pop("status", {})
    return {
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": created},
        "spec": {"model": {"name": model}, **spec},
        "status": status,
    }


def pod_obj(
    name: str, service: str, *, ready: bool = True, ip: str = "127.0.0.9", **extra: Any
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "labels": {
            "ladle.dev/inferenceservice": service,
            "ladle.dev/variant": extra.get("variant", "stable"),
        },
    }
    if extra.get("deleting"):
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {
            "containers": [{"ports": [{"name": "http", "containerPort": extra.get("port", 8000)}]}]
        },
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_service_defaults_match_the_crd_and_knobs_are_read() -> None:
    plain = parse_service(isvc("chat", "smollm2"))
    assert plain.weights == (("stable", 100),)
    assert plain.routing.load_factor == 1.25
    assert plain.routing.retries == 2
    assert plain.breaker.failure_rate == 0.5
    assert plain.outlier.consecutive_errors == 5
    tuned = parse_service(
        isvc(
            "chat",
            "smollm2",
            fallback="backup",
            routing={
                "loadFactorPercent": 150,
                "prefixChars": 64,
                "outlierDetection": {"consecutiveErrors": 2},
            },
            circuitBreaker={"minimumCalls": 3, "openSeconds": 4, "countRateLimited": True},
            timeouts={"firstTokenSeconds": 7},
            status={
                "rollout": {
                    "weights": [
                        {"variant": "stable", "weight": 95},
                        {"variant": "canary", "weight": 5},
                    ]
                }
            },
        )
    )
    assert tuned.fallback == "backup"
    assert tuned.routing.load_factor == 1.5
    assert tuned.routing.prefix_chars == 64
    assert tuned.outlier.consecutive_errors == 2
    assert tuned.breaker.minimum_calls == 3
    assert tuned.breaker.open_seconds == 4
    assert tuned.breaker.count_rate_limited
    assert tuned.timeouts.first_token_seconds == 7
    assert tuned.weights == (("stable", 95), ("canary", 5))


def test_pod_readiness_address_and_port() -> None:
    pod = parse_pod(pod_obj("chat-1", "chat", port=9000))
    assert pod is not None
    assert pod.ready
    assert (pod.host, pod.port) == ("127.0.0.9", 9000)
    assert not parse_pod(pod_obj("chat-2", "chat", ready=False)).ready  # type: ignore[union-attr]
    assert not parse_pod(pod_obj("chat-3", "chat", ip="")).ready  # type: ignore[union-attr]
    assert not parse_pod(pod_obj("chat-4", "chat", deleting=True)).ready  # type: ignore[union-attr]
    stray = pod_obj("x", "chat")
    stray["metadata"]["labels"] = {}
    assert parse_pod(stray) is None


def test_the_oldest_claim_on_a_model_wins_and_the_conflict_is_reported() -> None:
    a = parse_service(isvc("a", "llama", created="2026-01-02T00:00:00Z"))
    b = parse_service(isvc("b", "llama", created="2026-01-01T00:00:00Z"))
    c = parse_service(isvc("c", "qwen"))
    table = build_table([a, b, c], [])
    assert table.by_model["llama"].name == "b"
    conflict = table.conflicts["llama"]
    assert conflict.owner == ("ns", "b")
    assert table.conflict_of(("ns", "a")) is conflict
    assert table.conflict_of(("ns", "c")) is None
    kept = conflict_condition(("ns", "b"), conflict, 0.0)
    lost = conflict_condition(("ns", "a"), conflict, 0.0)
    assert (kept["reason"], lost["reason"]) == ("KeptByThisService", "RoutedElsewhere")
    assert "also claimed by ns/a" in kept["message"]
    assert "claimed by ns/b, the oldest claim" in lost["message"]
    assert conflict.others == (("ns", "a"),)
    assert "qwen" not in table.conflicts


def test_pods_group_by_service_and_variant() -> None:
    svc = parse_service(isvc("chat", "m"))
    pods = [
        parse_pod(pod_obj(f"chat-{i}", "chat", variant=v))
        for i, v in enumerate(["stable", "canary", "stable"])
    ]
    orphan = parse_pod(pod_obj("other-0", "other"))
    table = build_table([svc], [p for p in [*pods, orphan] if p is not None])
    assert {v: [p.name for p in ps] for v, ps in table.pods[("ns", "chat")].items()} == {
        "stable": ["chat-0", "chat-2"],
        "canary": ["chat-1"],
    }
    assert ("ns", "other") not in table.pods


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from(["stable", "canary"])), min_size=1, max_size=8
    ),
    st.lists(st.integers(0, 7), max_size=40),
    st.integers(0, 100),
)
def test_the_cluster_never_picks_an_unready_or_ejected_pod(
    pods: list[tuple[bool, str]], errors: list[int], canary_weight: int
) -> None:
    svc = parse_service(
        isvc(
            "chat",
            "m",
            routing={"outlierDetection": {"consecutiveErrors": 1, "maxEjectionPercent": 50}},
            status={
                "rollout": {
                    "weights": [
                        {"variant": "stable", "weight": 100 - canary_weight},
                        {"variant": "canary", "weight": canary_weight},
                    ]
                }
            },
        )
    )
    objs = [
        Pod("ns", f"chat-{i}", "chat", variant, "127.0.0.1", 8000 + i, ready)
        for i, (ready, variant) in enumerate(pods)
    ]
    now = 1.0
    cluster = Cluster(GatewayMetrics(), Pool(), rng=random.Random(0))
    cluster.update(build_table([svc], objs), now)
    state = cluster.states[("ns", "chat")]
    for i in errors:
        state.outlier.record(f"ns/chat-{i % len(objs)}", now, True, state.pod_count)
    ejected = state.outlier.ejected(now)
    unready = {p.id for p in objs if not p.ready}
    for n in range(30):
        ask = Ask(1, 3, "", math.inf, 1.0, set(), None, f"prefix {n}".encode())
        pod = cluster.place(state, ask, now)
        if pod is None:  # nothing to pick: the request would wait for a ready pod
            continue
        assert pod.id not in ejected
        assert pod.id not in unready
        weight = dict(svc.weights)[pod.variant]
        assert weight > 0


def test_a_service_claims_its_adapters_names_too() -> None:
    """Requests for an adapter go to the service whose pods serve it; an adapter named as
    another service's model (or adapter) is a conflict like any other, the oldest claim
    keeping the name."""
    adapters = [{"name": n, "source": {"image": {"path": f"/a/{n}"}}} for n in ("sql", "fr")]
    a = parse_service(isvc("a", "llama", adapters=adapters, created="2026-01-01T00:00:00Z"))
    b = parse_service(isvc("b", "sql", created="2026-01-02T00:00:00Z"))
    c = parse_service(isvc("c", "qwen"))
    assert a.names == ("llama", "sql", "fr")
    table = build_table([a, b, c], [])
    assert {m: s.name for m, s in table.by_model.items()} == {
        "llama": "a", "sql": "a", "fr": "a", "qwen": "c",
    }  # fmt: skip
    assert table.conflict_of(("ns", "b")) is table.conflicts["sql"]
    assert table.conflict_of(("ns", "a")) is table.conflicts["sql"]
    assert table.conflict_of(("ns", "c")) is None
    assert "adapters" in conflict_condition(("ns", "b"), table.conflicts["sql"], 0.0)["message"]
