"""Children → status: conditions as Argo CD, kstatus and an SRE read them."""

from __future__ import annotations

from typing import Any

from ladle.operator.api import InferenceService, parse_isvc, parse_pool
from ladle.operator.quota import Claim, plan_pool
from ladle.operator.status import (
    NodeInfo,
    UnschedulablePod,
    VariantObservation,
    derive_isvc_status,
    derive_pool_status,
    read_rollout,
)

Builder = Any
NOW = "2026-03-01T12:00:00Z"
INSUFFICIENT = (
    "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are "
    "available: 2 No preemption victims found for incoming pod."
)


def observe(
    isvc: InferenceService,
    deployment: dict[str, Any] | None,
    *,
    granted: int | None = None,
    unschedulable: tuple[UnschedulablePod, ...] = (),
    quota_note: str | None = None,
    service_exists: bool = True,
    service_error: str | None = None,
    conflict: str | None = None,
) -> dict[str, Any]:
    variant = VariantObservation(
        name="stable",
        quantization="none",
        image="img",
        deployment_name="chat-stable",
        deployment=deployment,
        requested_replicas=isvc.spec.replicas,
        granted_replicas=isvc.spec.replicas if granted is None else granted,
        gpu_resource="nvidia.com/gpu",
        unschedulable=unschedulable,
        quota_note=quota_note,
    )
    return derive_isvc_status(
        isvc,
        [variant],
        url="http://chat.team-a.svc.cluster.local/v1",
        selector="s",
        now=NOW,
        service_exists=service_exists,
        service_error=service_error,
        conflict=conflict,
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Ready, Progressing and Degraded (test_kstatus.py checks Reconciling and Stalled)."""
    kstatus = ("Reconciling", "Stalled")
    return {
        c["type"]: (c["status"], c["reason"])
        for c in status["conditions"]
        if c["type"] not in kstatus
    }


def test_available_rollout_is_ready(make_isvc: Builder, make_deployment: Builder) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}, generation=3))
    status = observe(isvc, make_deployment(2))
    assert conditions(status) == {
        "Ready": ("True", "Available"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert (status["replicas"], status["readyReplicas"], status["availableReplicas"]) == (2, 2, 2)
    assert status["url"] == "http://chat.team-a.svc.cluster.local/v1"
    assert status["variants"][0]["deployment"] == "chat-stable"


def test_ready_waits_for_the_service_behind_the_url(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())
    status = observe(isvc, make_deployment(1), service_exists=False)
    assert conditions(status) == {
        "Ready": ("False", "ServiceNotCreated"),
        "Progressing": ("True", "CreatingService"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["conditions"][0]["message"] == "Service chat is being created"
    assert status["availableReplicas"] == 1


def test_a_service_that_cannot_be_created_is_degraded_with_the_api_servers_words(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    why = "Service chat could not be created: 403 Forbidden: exceeded quota: services=0"
    isvc = parse_isvc(make_isvc())
    for deployment in (make_deployment(1), make_deployment(1, available=0, ready=0)):
        status = observe(
            isvc,
            deployment,
            service_exists=False,
            service_error="403 Forbidden: exceeded quota: services=0",
        )
        assert conditions(status)["Ready"] == ("False", "ServiceNotCreated")
        assert conditions(status)["Degraded"] == ("True", "ServiceNotCreated")
        assert status["conditions"][0]["message"] == why


def test_a_name_held_by_someone_elses_object_blocks_ready(make_isvc: Builder) -> None:
    why = "Deployment chat-stable exists and is not ours: Apply failed with 1 conflict"
    status = observe(parse_isvc(make_isvc()), None, conflict=why)
    assert conditions(status)["Ready"] == ("False", "ChildConflict")
    assert conditions(status)["Degraded"] == ("True", "ChildConflict")
    assert status["conditions"][0]["message"] == why


def test_rollout_in_progress_is_progressing_not_ready(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}))
    status = observe(isvc, make_deployment(2, updated=1, available=1, total=3))
    assert conditions(status) == {
        "Ready": ("False", "RollingOut"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    assert "1/2 updated, 1 available" in status["conditions"][0]["message"]


def test_a_deployment_that_has_not_seen_its_new_spec_is_not_complete(
    make_deployment: Builder,
) -> None:
    assert not read_rollout(make_deployment(1, generation=2, observed=1), 1).complete
    assert read_rollout(make_deployment(1, generation=2, observed=2), 1).complete
    assert not read_rollout(make_deployment(1), 2).complete  # not yet scaled to the grant
    assert not read_rollout(None, 1).exists


def test_missing_gpus_are_degraded_with_the_schedulers_words(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())
    pod = UnschedulablePod("chat-stable-abc-1", INSUFFICIENT)
    status = observe(isvc, make_deployment(1, available=0, ready=0), unschedulable=(pod,))
    assert conditions(status) == {
        "Ready": ("False", "InsufficientGPUs"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("True", "InsufficientGPUs"),
    }
    degraded = status["conditions"][2]["message"]
    assert degraded.startswith("1 pod of Deployment chat-stable cannot be scheduled: ")
    assert "2 Insufficient nvidia.com/gpu" in degraded


def test_other_scheduling_failures_say_unschedulable(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    pod = UnschedulablePod("p", "0/2 nodes are available: 2 node(s) didn't match selector.")
    status = observe(parse_isvc(make_isvc()), make_deployment(1, available=0), unschedulable=(pod,))
    assert conditions(status)["Degraded"] == ("True", "Unschedulable")


def test_stalled_rollout_stops_progressing(make_isvc: Builder, make_deployment: Builder) -> None:
    stalled = {
        "type": "Progressing",
        "status": "False",
        "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "chat-stable-1" has timed out progressing.',
    }
    status = observe(parse_isvc(make_isvc()), make_deployment(1, available=0, conditions=[stalled]))
    assert conditions(status) == {
        "Ready": ("False", "ProgressDeadlineExceeded"),
        "Progressing": ("False", "ProgressDeadlineExceeded"),
        "Degraded": ("True", "ProgressDeadlineExceeded"),
    }


def test_quota_capped_service_is_ready_at_its_grant_and_degraded(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 3}))
    note = "GPUPool p quota of 2 GPUs allows 2 of 3 replicas"
    status = observe(isvc, make_deployment(2), granted=2, quota_note=note)
    assert conditions(status) == {
        "Ready": ("True", "Available"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("True", "QuotaExceeded"),
    }
    assert "(quota allows 2 of 3 requested)" in status["conditions"][0]["message"]
    assert status["conditions"][2]["message"] == note
    assert status["variants"][0]["requestedReplicas"] == 3
    assert status["variants"][0]["desiredReplicas"] == 2


def test_a_service_granted_nothing_is_not_ready_even_mid_rollout(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    # The Deployment has not yet observed its scale-down to 0.
    unobserved = make_deployment(0, generation=2, observed=1, total=1, updated=1, available=1)
    status = observe(parse_isvc(make_isvc()), unobserved, granted=0, quota_note="full")
    assert conditions(status)["Ready"] == ("False", "QuotaExceeded")
    assert conditions(status)["Degraded"] == ("True", "QuotaExceeded")


def test_a_service_granted_nothing_is_not_ready(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    status = observe(parse_isvc(make_isvc()), make_deployment(0), granted=0, quota_note="full")
    assert conditions(status)["Ready"] == ("False", "QuotaExceeded")


def test_scaled_to_zero_is_ready(make_isvc: Builder, make_deployment: Builder) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 0, "minReplicas": 0}))
    status = observe(isvc, make_deployment(0))
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")
    # It says plainly what happens to the next request, and what to do about it.
    message = status["conditions"][0]["message"]
    assert "holds each request" in message
    assert "503 no_ready_pods" in message
    assert "raise spec.replicas" in message


def test_missing_pool_is_degraded(make_isvc: Builder) -> None:
    isvc = parse_isvc(make_isvc(spec={"gpuPool": "gone"}))
    variant = VariantObservation(
        "stable", "none", "img", "chat-stable", None, 1, 1, "nvidia.com/gpu"
    )
    status = derive_isvc_status(
        isvc, [variant], url="u", selector="s", now=NOW, pool_problem='GPUPool "gone" is missing'
    )
    assert conditions(status) == {
        "Ready": ("False", "GPUPoolNotFound"),
        "Progressing": ("False", "GPUPoolNotFound"),
        "Degraded": ("True", "GPUPoolNotFound"),
    }


def test_transition_times_move_only_when_status_changes(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())
    first = observe(isvc, make_deployment(1, available=0))
    earlier = [{**c, "lastTransitionTime": "2026-01-01T00:00:00Z"} for c in first["conditions"]]
    isvc = parse_isvc(make_isvc(status={"conditions": earlier}))
    second = observe(isvc, make_deployment(1))
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    # Ready, Progressing and Reconciling flipped; Degraded and Stalled stayed False.
    before = "2026-01-01T00:00:00Z"
    assert times == {
        "Ready": NOW,
        "Progressing": NOW,
        "Reconciling": NOW,
        "Degraded": before,
        "Stalled": before,
    }


def node(name: str, labels: dict[str, str], gpus: str = "8", ready: bool = True) -> NodeInfo:
    return NodeInfo(name, labels, ready, False, {"nvidia.com/gpu": gpus}, {"nvidia.com/gpu": gpus})


def test_pool_status_counts_matching_nodes_claims_and_quota(make_pool: Builder) -> None:
    pool = parse_pool(
        make_pool(spec={"nodeSelector": {"zone": "a"}, "product": "H200", "quota": {"gpus": 4}})
    )
    nodes = [
        node("n1", {"zone": "a", "nvidia.com/gpu.product": "H200"}),
        node("n2", {"zone": "a", "nvidia.com/gpu.product": "H200"}, ready=False),
        node("n3", {"zone": "b", "nvidia.com/gpu.product": "H200"}),
        node("n4", {"zone": "a", "nvidia.com/gpu.product": "A100"}),
        node("n5", {"zone": "a", "nvidia.com/gpu.product": "H200"}, gpus="0"),
    ]
    plan = plan_pool(4, [Claim("x", "1", 3, 1), Claim("y", "2", 3, 1)])
    status = derive_pool_status(pool, nodes, plan, 2, NOW)
    assert {k: status[k] for k in ("nodes", "capacity", "allocatable", "claimed", "requested")} == {
        "nodes": 2,
        "capacity": 16,
        "allocatable": 8,
        "claimed": 4,
        "requested": 6,
    }
    assert status["inferenceServices"] == 2
    assert conditions(status) == {
        "Ready": ("True", "NodesAvailable"),
        "Degraded": ("True", "QuotaExceeded"),
    }
    assert (
        "request 6 GPUs but the quota is 4; 2 GPUs are withheld"
        in (status["conditions"][1]["message"])
    )


def test_pool_without_nodes_is_not_ready(make_pool: Builder) -> None:
    pool = parse_pool(make_pool(spec={"nodeSelector": {"zone": "z"}}))
    status = derive_pool_status(pool, [node("n1", {"zone": "a"})], plan_pool(None, []), 0, NOW)
    assert conditions(status) == {
        "Ready": ("False", "NoMatchingNodes"),
        "Degraded": ("False", "AsExpected"),
    }
