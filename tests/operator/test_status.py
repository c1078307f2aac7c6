"""Observations → status: conditions as Argo CD, kstatus and an SRE read them."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.api import InferenceService, parse_isvc, parse_pool, parse_rfc3339
from ladle.operator.adapter_status import AdaptersObservation, PodAdapters
from ladle.operator.adapter_status import observe as observe_adapters
from ladle.operator.pod_problems import (
    STARTUP_GRACE_SECONDS,
    PodProblem,
    start_failure,
    startup_look,
)
from ladle.operator.pool_status import PoolFacts, derive_pool_status
from ladle.operator.quota import Claim, plan_pool
from ladle.operator.rollout_state import RolloutState
from ladle.operator.status import Problem, VariantObservation, derive_isvc_status, read_rollout
from ladle.operator.store import NodeInfo, PodInfo

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
    pods: tuple[PodProblem, ...] = (),
    quota_note: str | None = None,
    service_exists: bool = True,
    service_error: str | None = None,
    blockers: tuple[Problem, ...] = (),
    rollout: RolloutState | None = None,
    adapters: AdaptersObservation | None = None,
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
        pod_problems=pods,
        quota_note=quota_note,
    )
    return derive_isvc_status(
        isvc,
        [variant],
        url="http://chat.team-a.svc.cluster.local/v1",
        selector="s",
        now=NOW,
        blockers=blockers,
        service_exists=service_exists,
        service_error=service_error,
        rollout=rollout,
        adapters=adapters,
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def message(status: dict[str, Any], type_: str) -> str:
    return next(str(c["message"]) for c in status["conditions"] if c["type"] == type_)


def test_available_rollout_is_ready_and_current_for_kstatus(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}, generation=3))
    status = observe(isvc, make_deployment(2))
    assert conditions(status) == {
        "Ready": ("True", "Available"),
        "Progressing": ("False", "RolloutComplete"),
        "Reconciling": ("False", "RolloutComplete"),
        "Stalled": ("False", "AsExpected"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert (status["replicas"], status["readyReplicas"], status["availableReplicas"]) == (2, 2, 2)
    assert status["url"] == "http://chat.team-a.svc.cluster.local/v1"
    assert status["variants"][0]["deployment"] == "chat-stable"


def test_a_spec_edit_rolling_out_with_no_unavailability_stays_ready(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    # maxSurge 1, maxUnavailable 0: the old replicas serve until the new ones are available.
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}, generation=4))
    rolling = make_deployment(2, generation=5, observed=5, updated=1, available=2, total=3)
    status = observe(isvc, rolling)
    assert conditions(status)["Ready"] == ("True", "RollingOut")
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    assert conditions(status)["Reconciling"] == ("True", "RollingOut")
    # The third pod is the surge, not something to scale down.
    assert message(status, "Ready") == (
        "serving 2/2 replicas available while rolling out: "
        "chat-stable: 1/2 replicas updated, 2/2 available"
    )


def test_ready_waits_for_the_service_behind_the_url(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())
    status = observe(isvc, make_deployment(1), service_exists=False)
    assert conditions(status)["Ready"] == ("False", "ServiceNotCreated")
    assert conditions(status)["Progressing"] == ("True", "CreatingService")
    assert conditions(status)["Stalled"] == ("False", "AsExpected")
    assert message(status, "Ready") == "Service chat is being created"
    assert status["availableReplicas"] == 1


def test_a_service_that_cannot_be_created_is_stalled_in_the_api_servers_words(
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
        assert conditions(status)["Stalled"] == ("True", "ServiceNotCreated")
        assert message(status, "Ready") == why


def test_a_generation_that_was_not_applied_never_reads_ready(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    """The old Deployment still runs generation 2 complete and available; generation 3 could
    not be applied (its pool is gone, a child's name is taken, the apply was refused)."""
    isvc = parse_isvc(make_isvc(generation=3))
    for blocker in (
        Problem("GPUPoolNotFound", 'GPUPool "gone" does not exist', stalls=True),
        Problem("ChildConflict", "Deployment chat-stable exists and is not ours", stalls=True),
        Problem("ApplyFailed", "Deployment chat-stable: 422 Invalid: denied", stalls=True),
    ):
        status = observe(isvc, make_deployment(1, generation=2, observed=2), blockers=(blocker,))
        assert conditions(status) == {
            "Ready": ("False", blocker.reason),
            "Progressing": ("False", blocker.reason),
            "Reconciling": ("False", blocker.reason),
            "Stalled": ("True", blocker.reason),
            "Degraded": ("True", blocker.reason),
        }
        assert message(status, "Ready") == blocker.message
        assert status["observedGeneration"] == 3


def test_a_passing_apply_error_is_degraded_but_still_reconciling(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    blocker = Problem("ApplyFailed", "Deployment chat-stable: 500 InternalError: etcd timeout")
    status = observe(parse_isvc(make_isvc()), make_deployment(1), blockers=(blocker,))
    assert conditions(status)["Ready"] == ("False", "ApplyFailed")
    assert conditions(status)["Reconciling"] == ("True", "ApplyFailed")
    assert conditions(status)["Degraded"] == ("True", "ApplyFailed")
    assert conditions(status)["Stalled"] == ("False", "AsExpected")


def test_rollout_in_progress_is_progressing_not_ready(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}))
    status = observe(isvc, make_deployment(2, updated=1, available=1, total=3))
    assert conditions(status)["Ready"] == ("False", "RollingOut")
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    assert conditions(status)["Degraded"] == ("False", "AsExpected")
    assert "1/2 replicas updated, 1/2 available" in message(status, "Ready")


def test_counts_after_a_hand_scale_read_sensibly(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    # Someone scaled the Deployment to 5 by hand; the operator wants 2 and scales it back.
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}))
    status = observe(isvc, make_deployment(2, generation=3, observed=3, total=5, available=5))
    assert "5/2" not in message(status, "Progressing")
    assert message(status, "Progressing") == (
        "chat-stable: 2/2 replicas updated, 2/2 available; scaling down from 5"
    )


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
    pod = PodProblem("chat-stable-abc-1", "Unschedulable", INSUFFICIENT)
    status = observe(isvc, make_deployment(1, available=0, ready=0), pods=(pod,))
    assert conditions(status)["Ready"] == ("False", "InsufficientGPUs")
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    assert conditions(status)["Degraded"] == ("True", "InsufficientGPUs")
    assert conditions(status)["Stalled"] == ("False", "AsExpected")
    degraded = message(status, "Degraded")
    assert degraded.startswith("1 pod of Deployment chat-stable cannot be scheduled: ")
    assert "2 Insufficient nvidia.com/gpu" in degraded


def test_a_pod_no_node_fits_for_other_resources_is_unschedulable_however_short_the_gpus(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())

    def reason(scheduler: str) -> str:
        pod = PodProblem(
            "chat-stable-abc-1", "Unschedulable", f"0/3 nodes are available: {scheduler}"
        )
        status = observe(isvc, make_deployment(1, available=0, ready=0), pods=(pod,))
        assert scheduler in message(status, "Degraded")
        return conditions(status)["Degraded"][1]

    # No node has the CPUs, whether or not the GPUs are busy too.
    assert reason("3 Insufficient cpu, 2 Insufficient nvidia.com/gpu.") == "Unschedulable"
    assert reason("3 Insufficient cpu, 3 Insufficient nvidia.com/gpu.") == "Unschedulable"
    # No node has the GPUs; one is also short of memory.
    assert reason("1 Insufficient memory, 3 Insufficient nvidia.com/gpu.") == "InsufficientGPUs"


def test_a_container_that_cannot_start_says_why_in_the_kubelets_words(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    secret = 'secret "chat-key" not found'
    isvc = parse_isvc(make_isvc())
    pods = (
        PodProblem("chat-stable-abc-1", "CreateContainerConfigError", secret),
        PodProblem("chat-stable-abc-2", "CreateContainerConfigError", secret),
    )
    status = observe(isvc, make_deployment(2, available=0, ready=0), granted=2, pods=pods)
    assert conditions(status)["Ready"] == ("False", "CreateContainerConfigError")
    assert conditions(status)["Stalled"] == ("True", "CreateContainerConfigError")
    assert conditions(status)["Reconciling"][0] == "False"
    assert message(status, "Ready") == (
        "2 pods of Deployment chat-stable cannot start: CreateContainerConfigError: " + secret
    )
    pulling = observe(
        isvc,
        make_deployment(1, available=0, ready=0),
        pods=(PodProblem("p", "ImagePullBackOff", "Back-off pulling image"),),
    )
    # An image pull may still succeed: degraded, not stalled (until the progress deadline).
    assert conditions(pulling)["Ready"] == ("False", "ImagePullBackOff")
    assert conditions(pulling)["Stalled"] == ("False", "AsExpected")


def test_other_scheduling_failures_say_unschedulable(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    pod = PodProblem("p", "Unschedulable", "0/2 nodes are available: 2 node(s) didn't match.")
    status = observe(parse_isvc(make_isvc()), make_deployment(1, available=0), pods=(pod,))
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
        "Reconciling": ("False", "ProgressDeadlineExceeded"),
        "Stalled": ("True", "ProgressDeadlineExceeded"),
        "Degraded": ("True", "ProgressDeadlineExceeded"),
    }


DEADLINE = {
    "type": "Progressing",
    "status": "False",
    "reason": "ProgressDeadlineExceeded",
    "message": 'ReplicaSet "chat-stable-1" has timed out progressing.',
}
MISSING_SECRET = 'MountVolume.SetUp failed for volume "api-key" : secret "chat-key" not found'


def event(reason: str, at: str, message: str = "", type_: str = "Warning") -> dict[str, Any]:
    return {"type": type_, "reason": reason, "message": message, "lastTimestamp": at}


def test_a_pod_waiting_to_start_is_read_from_its_status_until_a_container_starts() -> None:
    def pod(status: dict[str, Any], node: str | None = "n1") -> PodInfo:
        return PodInfo.from_pod(
            {
                "metadata": {"name": "p", "namespace": "a", "labels": {}},
                "spec": {"nodeName": node} if node else {},
                "status": status,
            }
        )

    creating = {"state": {"waiting": {"reason": "ContainerCreating"}}}
    started = "2026-03-01T12:00:00Z"
    waiting = pod({"phase": "Pending", "startTime": started, "containerStatuses": [creating]})
    assert waiting.starting_since == parse_rfc3339(started)
    assert waiting.problem is None
    # Bound, but the kubelet has not reported yet: since the binding.
    bound = {"type": "PodScheduled", "status": "True", "lastTransitionTime": started}
    assert pod({"phase": "Pending", "conditions": [bound]}).starting_since == parse_rfc3339(started)
    # Not bound; running; or waiting for a reason of its own: not "starting".
    assert pod({"phase": "Pending"}, node=None).starting_since is None
    running = {"state": {"running": {"startedAt": started}}}
    assert (
        pod(
            {"phase": "Running", "startTime": started, "containerStatuses": [running]}
        ).starting_since
        is None
    )
    config = {"state": {"waiting": {"reason": "CreateContainerConfigError", "message": "m"}}}
    refused = pod({"phase": "Pending", "startTime": started, "containerStatuses": [config]})
    assert refused.starting_since is None
    assert refused.problem == ("CreateContainerConfigError", "m")


def test_waiting_pods_are_looked_at_after_a_grace_then_less_and_less_often() -> None:
    now = 1000.0
    assert startup_look({}, now).wake_in is None
    # Just started: nothing to read yet, and a look is due when the grace period is over.
    fresh = startup_look({"a": now - 1}, now)
    assert fresh.pods == ()
    assert fresh.wake_in == STARTUP_GRACE_SECONDS - 1
    # Waited 5 s: read now, again in 5 s; waited 10 min: read now, again in a minute.
    assert startup_look({"a": now - 5}, now) == type(fresh)(("a",), 5.0)
    assert startup_look({"a": now - 600}, now).wake_in == 60.0
    assert startup_look({"a": now - 40}, now).wake_in == 20.0
    # The longest waiting first, at most three per look; the soonest wake of all of them.
    many = startup_look(
        {"a": now - 30, "b": now - 50, "c": now - 6, "d": now - 20, "e": now - 2}, now
    )
    assert many.pods == ("b", "a", "d")
    assert many.wake_in == 3.0


def test_a_pods_events_say_why_it_cannot_start_until_it_gets_past_them() -> None:
    assert start_failure([]) is None
    mount = event("FailedMount", "2026-03-01T12:00:02Z", MISSING_SECRET)
    assert start_failure([mount]) == ("FailedMount", MISSING_SECRET)
    scheduled = event("Scheduled", "2026-03-01T12:00:01Z", "assigned", "Normal")
    assert start_failure([scheduled, mount]) == ("FailedMount", MISSING_SECRET)
    # The kubelet's two-minute summary says less than the SetUp failure it keeps repeating.
    summary = event(
        "FailedMount",
        "2026-03-01T12:02:02Z",
        "Unable to attach or mount volumes: unmounted volumes=[api-key]: timed out",
    )
    assert start_failure([summary, mount]) == ("FailedMount", MISSING_SECRET)
    assert start_failure([summary])[1].startswith("Unable to attach")  # type: ignore[index]
    # Volumes before sandboxes, when both hold.
    sandbox = event("FailedCreatePodSandBox", "2026-03-01T12:00:03Z", "no CNI")
    assert start_failure([sandbox, mount]) == ("FailedMount", MISSING_SECRET)
    assert start_failure([sandbox]) == ("FailedCreatePodSandBox", "no CNI")
    # The Secret appeared: the image is pulled (same second counts) and the failure is over,
    # though an image pull may keep the pod ContainerCreating a while longer.
    pulled = event("Pulled", "2026-03-01T12:00:02Z", "already present", "Normal")
    assert start_failure([mount, pulled]) is None
    # Events the new API writes (series, eventTime) are read too.
    later = {
        "type": "Warning",
        "reason": "FailedAttachVolume",
        "message": 'AttachVolume.Attach failed for volume "pv-1" : timed out',
        "eventTime": "2026-03-01T12:00:01.000000Z",
        "series": {"count": 3, "lastObservedTime": "2026-03-01T12:00:09.500000Z"},
    }
    assert start_failure([pulled, later]) == ("FailedAttachVolume", later["message"])
    assert start_failure([event("BackOff", "2026-03-01T12:00:09Z", "back-off")]) is None


def test_a_volume_that_cannot_be_mounted_reads_degraded_in_the_kubelets_words(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())
    waiting = make_deployment(1, available=0, ready=0)
    status = observe(isvc, waiting, pods=(PodProblem("p", "FailedMount", MISSING_SECRET),))
    assert conditions(status)["Ready"] == ("False", "FailedMount")
    assert conditions(status)["Degraded"] == ("True", "FailedMount")
    # A missing Secret needs someone to create it, as for CreateContainerConfigError.
    assert conditions(status)["Stalled"] == ("True", "FailedMount")
    assert message(status, "Degraded") == (
        f"1 pod of Deployment chat-stable cannot start: FailedMount: {MISSING_SECRET}"
    )
    # An attach that times out may still succeed: degraded, not stalled (until the deadline).
    attach = PodProblem("p", "FailedAttachVolume", "AttachVolume.Attach failed: timed out")
    slow = observe(isvc, waiting, pods=(attach,))
    assert conditions(slow)["Ready"] == ("False", "FailedAttachVolume")
    assert conditions(slow)["Stalled"] == ("False", "AsExpected")
    assert conditions(slow)["Progressing"] == ("True", "RollingOut")


def test_past_the_progress_deadline_the_pods_own_reason_stays_the_reason(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())
    stalled = make_deployment(1, available=0, ready=0, conditions=[DEADLINE])
    for pod in (
        PodProblem("p", "Unschedulable", INSUFFICIENT),
        PodProblem("p", "CreateContainerConfigError", 'secret "chat-key" not found'),
        PodProblem("p", "FailedMount", MISSING_SECRET),
        PodProblem("p", "ImagePullBackOff", "Back-off pulling image"),
    ):
        status = observe(isvc, stalled, pods=(pod,))
        reason = "InsufficientGPUs" if pod.reason == "Unschedulable" else pod.reason
        assert conditions(status) == {
            "Ready": ("False", reason),
            "Progressing": ("False", reason),
            "Reconciling": ("False", reason),
            "Stalled": ("True", reason),
            "Degraded": ("True", reason),
        }, pod
        for type_ in ("Ready", "Stalled", "Degraded"):
            text = message(status, type_)
            assert pod.message in text
            assert text.endswith(
                '(progress deadline exceeded: ReplicaSet "chat-stable-1" has timed out '
                "progressing.)"
            )


def test_quota_capped_service_is_ready_at_its_grant_and_says_so_in_the_reason(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 3}))
    note = "GPUPool p quota of 2 GPUs allows 2 of 3 replicas"
    status = observe(isvc, make_deployment(2), granted=2, quota_note=note)
    assert conditions(status)["Ready"] == ("True", "QuotaCapped")
    assert conditions(status)["Degraded"] == ("True", "QuotaExceeded")
    assert conditions(status)["Stalled"] == ("False", "AsExpected")
    assert message(status, "Ready") == (
        "2/2 replicas available; the GPUPool quota allows 2 of 3 requested"
    )
    assert message(status, "Degraded") == note
    assert status["variants"][0]["requestedReplicas"] == 3
    assert status["variants"][0]["desiredReplicas"] == 2


def test_a_service_granted_nothing_is_stalled_even_mid_rollout(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    # The Deployment has not yet observed its scale-down to 0.
    unobserved = make_deployment(0, generation=2, observed=1, total=1, updated=1, available=1)
    for deployment in (unobserved, make_deployment(0)):
        status = observe(parse_isvc(make_isvc()), deployment, granted=0, quota_note="full")
        assert conditions(status)["Ready"] == ("False", "QuotaExceeded")
        assert conditions(status)["Stalled"] == ("True", "QuotaExceeded")
        assert conditions(status)["Degraded"] == ("True", "QuotaExceeded")


def test_scaled_to_zero_is_ready(make_isvc: Builder, make_deployment: Builder) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 0, "minReplicas": 0}))
    status = observe(isvc, make_deployment(0))
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")
    # It says plainly what happens to the next request, and what to do about it.
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert "holds each request" in ready["message"]
    assert "503 no_ready_pods" in ready["message"]
    assert "raise spec.replicas" in ready["message"]


def in_canary(
    make_isvc: Builder, make_deployment: Builder, state: RolloutState, canary_available: int = 1
) -> dict[str, Any]:
    """Two replicas of stable and one canary replica, split by ``state``'s weight."""
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}))
    variants = [
        VariantObservation(
            "stable", "none", "img", "chat-stable", make_deployment(2), 2, 2, "nvidia.com/gpu",
            weight=100 - state.weight,
        ),
        VariantObservation(
            "canary", "int8", "img", "chat-canary", make_deployment(1, available=canary_available),
            1, 1, "nvidia.com/gpu", weight=state.weight,
        ),
    ]  # fmt: skip
    return derive_isvc_status(isvc, variants, url="u", selector="s", now=NOW, rollout=state)


def canary_state(**fields: Any) -> RolloutState:
    return RolloutState(stable_revision="r1", canary_revision="r2", **fields)


def test_a_canary_rollout_is_reconciling_and_stays_ready(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    state = canary_state(phase="Progressing", stage="Analysing", step=1, weight=25, message="m")
    status = in_canary(make_isvc, make_deployment, state)
    assert conditions(status) == {
        "Ready": ("True", "RollingOut"),
        "Progressing": ("True", "CanaryRollout"),
        "Reconciling": ("True", "CanaryRollout"),
        "Stalled": ("False", "AsExpected"),
        "Degraded": ("False", "AsExpected"),
    }


def test_a_paused_rollout_waits_for_a_person_so_kstatus_reads_current(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    """A pause never ends by itself (no deadline runs while paused): with Reconciling True
    kstatus would read InProgress forever and a Flux or `kubectl wait` would time out. Paused
    reads as a Job that is suspended does in newer cli-utils: Current. Argo CD shows it
    Suspended from status.rollout.phase."""
    paused = "paused at step 1 with 25% to the canary (spec.rollout.paused)"
    state = canary_state(phase="Paused", stage="Analysing", step=1, weight=25, message=paused)
    status = in_canary(make_isvc, make_deployment, state)
    assert conditions(status) == {
        "Ready": ("True", "RollingOut"),
        "Progressing": ("False", "RolloutPaused"),
        "Reconciling": ("False", "RolloutPaused"),
        "Stalled": ("False", "AsExpected"),
        "Degraded": ("False", "AsExpected"),
    }
    assert message(status, "Reconciling") == paused
    # Awaiting a manual promotion is the same kind of wait.
    awaiting = canary_state(phase="Paused", stage="AwaitingPromotion", step=3, weight=100)
    status = in_canary(make_isvc, make_deployment, awaiting)
    assert conditions(status)["Reconciling"] == ("False", "RolloutPaused")


def test_a_paused_rollout_still_reconciles_until_the_held_step_is_up(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    state = canary_state(phase="Paused", stage="Scaling", step=0, weight=0, message="paused")
    status = in_canary(make_isvc, make_deployment, state, canary_available=0)
    assert conditions(status)["Ready"] == ("True", "RollingOut")  # the canary has no traffic
    assert conditions(status)["Progressing"] == ("True", "RolloutPaused")
    assert conditions(status)["Reconciling"] == ("True", "RolloutPaused")
    assert message(status, "Reconciling").startswith("paused; ")
    assert "chat-canary: 1/1 replicas updated, 0/1 available" in message(status, "Reconciling")


def test_a_rolled_back_canary_names_the_gate_once(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}))
    state = RolloutState(
        phase="RolledBack",
        stable_revision="r1",
        failed_revision="r2",
        reason="QualityGateFailed",
        message="QualityGateFailed: top-1 agreement 0.81 < 0.95 (KLD 0.21)",
    )
    variant = VariantObservation(
        "stable", "none", "img", "chat-stable", make_deployment(2), 2, 2, "nvidia.com/gpu"
    )
    status = derive_isvc_status(isvc, [variant], url="u", selector="s", now=NOW, rollout=state)
    assert conditions(status)["Ready"] == ("True", "Available")  # stable serves
    assert conditions(status)["Degraded"] == ("True", "QualityGateFailed")
    assert message(status, "Degraded") == "top-1 agreement 0.81 < 0.95 (KLD 0.21)"
    assert status["rollout"]["message"] == state.message


def test_transition_times_move_only_when_status_changes(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc())
    first = observe(isvc, make_deployment(1, available=0))
    earlier = [{**c, "lastTransitionTime": "2026-01-01T00:00:00Z"} for c in first["conditions"]]
    isvc = parse_isvc(make_isvc(status={"conditions": earlier}))
    second = observe(isvc, make_deployment(1))
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    # Ready, Progressing and Reconciling flipped; Stalled and Degraded stayed False.
    assert times == {
        "Ready": NOW,
        "Progressing": NOW,
        "Reconciling": NOW,
        "Stalled": "2026-01-01T00:00:00Z",
        "Degraded": "2026-01-01T00:00:00Z",
    }


rollouts = st.builds(
    dict,
    want=st.integers(0, 4),
    spec=st.integers(0, 4),
    total=st.integers(0, 6),
    updated=st.integers(0, 6),
    available=st.integers(0, 6),
    observed=st.booleans(),
    deadline=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    rollout=st.one_of(st.none(), rollouts),
    requested=st.integers(0, 4),
    pods=st.lists(
        st.sampled_from(
            ["Unschedulable", "CreateContainerConfigError", "ImagePullBackOff", "FailedMount"]
        ),
        max_size=2,
    ),
    blocked=st.sampled_from([None, "GPUPoolNotFound", "ApplyFailed", "ApplyFailedPassing"]),
    service=st.sampled_from(["exists", "pending", "refused"]),
    canary=st.sampled_from([None, "Progressing", "Paused", "RolledBack"]),
)
def test_the_conditions_keep_their_promises(
    rollout: dict[str, Any] | None,
    requested: int,
    pods: list[str],
    blocked: str | None,
    service: str,
    canary: str | None,
) -> None:
    """The invariants docs/operator.md states, over arbitrary observations."""
    isvc = parse_isvc(
        {
            "metadata": {"name": "chat", "namespace": "a", "uid": "u", "generation": 2},
            "spec": {"model": {"name": "m"}, "replicas": requested, "minReplicas": 0},
        }
    )
    deployment = None
    granted = rollout["want"] if rollout else requested
    if rollout is not None:
        deployment = {
            "metadata": {"generation": 2},
            "spec": {"replicas": rollout["spec"]},
            "status": {
                "observedGeneration": 2 if rollout["observed"] else 1,
                "replicas": rollout["total"],
                "updatedReplicas": rollout["updated"],
                "readyReplicas": rollout["available"],
                "availableReplicas": rollout["available"],
                "conditions": [{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]
                if rollout["deadline"]
                else [],
            },
        }
    blockers = ()
    if blocked:
        blockers = (Problem(blocked, "why", stalls=blocked != "ApplyFailedPassing"),)
    status = observe(
        isvc,
        deployment,
        granted=granted,
        pods=tuple(PodProblem(f"p{i}", reason, "m") for i, reason in enumerate(pods)),
        quota_note="capped" if granted < requested else None,
        service_exists=service == "exists",
        service_error="403 Forbidden" if service == "refused" else None,
        blockers=blockers,
        rollout=None
        if canary is None
        else RolloutState(
            phase=canary,  # type: ignore[arg-type]
            stable_revision="r1",
            canary_revision=None if canary == "RolledBack" else "r2",
            failed_revision="r2" if canary == "RolledBack" else None,
            reason="SLOGateFailed" if canary == "RolledBack" else None,
            message=f"{canary}: why",
        ),
    )
    on = {c["type"]: c["status"] == "True" for c in status["conditions"]}
    assert status["observedGeneration"] == 2
    assert not (on["Ready"] and on["Stalled"])
    assert not (on["Reconciling"] and on["Stalled"])
    assert on["Reconciling"] == on["Progressing"]
    if on["Stalled"]:
        assert on["Degraded"]
    if on["Ready"]:
        assert not blocked  # a generation not applied never reads Ready
        assert service == "exists"
        assert requested == 0 or status["availableReplicas"] >= granted > 0
    if not on["Ready"] and not on["Reconciling"] and not on["Stalled"]:
        # At rest and not serving: only a quota that grants nothing gets here, and it stalls.
        raise AssertionError(f"neither ready, reconciling nor stalled: {conditions(status)}")


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
    status = derive_pool_status(pool, nodes, plan, PoolFacts(2), NOW)
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
    assert message(status, "Ready") == "1 schedulable node offers 8 nvidia.com/gpu"
    assert "request 6 GPUs but the quota is 4; 2 GPUs are withheld" in message(status, "Degraded")


def test_pool_messages_count_in_good_grammar(make_pool: Builder) -> None:
    pool = parse_pool(make_pool(spec={"quota": {"gpus": 0}}))
    plan = plan_pool(0, [Claim("x", "1", 1, 1)])
    status = derive_pool_status(pool, [node("n1", {}, gpus="1")], plan, PoolFacts(1), NOW)
    assert "request 1 GPU but the quota is 0; 1 GPU is withheld" in message(status, "Degraded")
    assert "1 GPUs" not in str(status)


def test_overlapping_pools_and_a_blocked_deletion_are_reported(make_pool: Builder) -> None:
    pool = parse_pool(make_pool())
    facts = PoolFacts(2, overlaps={"other": 3}, blocking_deletion=("team-a/chat", "team-b/x"))
    status = derive_pool_status(pool, [node("n1", {})], plan_pool(None, []), facts, NOW)
    assert conditions(status)["Degraded"] == ("True", "DeletionBlocked")
    degraded = message(status, "Degraded")
    assert "deletion waits for 2 InferenceServices that still use this pool: team-a/chat" in (
        degraded
    )
    assert "shares 3 nodes with GPUPool other" in degraded


def test_pool_without_nodes_is_not_ready(make_pool: Builder) -> None:
    pool = parse_pool(make_pool(spec={"nodeSelector": {"zone": "z"}}))
    status = derive_pool_status(
        pool, [node("n1", {"zone": "a"})], plan_pool(None, []), PoolFacts(0), NOW
    )
    assert conditions(status) == {
        "Ready": ("False", "NoMatchingNodes"),
        "Degraded": ("False", "AsExpected"),
    }


def test_an_adapter_a_pod_cannot_serve_degrades_the_service_that_stays_ready(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 1}))
    failed = PodAdapters("chat-stable-1", "stable", ("sql",), {"wide": "rank 64 exceeds 16"})
    status = observe(
        isvc, make_deployment(1), adapters=observe_adapters({"stable": ["sql", "wide"]}, [failed])
    )
    assert conditions(status) == {
        "Ready": ("True", "Available"),
        "Progressing": ("False", "RolloutComplete"),
        "Reconciling": ("False", "RolloutComplete"),
        "Stalled": ("False", "AsExpected"),
        "Degraded": ("True", "AdapterLoadFailed"),
        "AdaptersReady": ("False", "AdapterLoadFailed"),
    }
    assert message(status, "Degraded") == "wide on chat-stable-1: rank 64 exceeds 16"
    assert status["adapters"][0]["loaded"] == ["sql"]
    loading = observe(
        isvc,
        make_deployment(1),
        adapters=observe_adapters({"stable": ["sql"]}, [PodAdapters("p", "stable")]),
    )
    assert conditions(loading)["Degraded"] == ("False", "AsExpected")
    assert conditions(loading)["AdaptersReady"] == ("False", "Loading")
    assert "adapters" not in observe(isvc, make_deployment(1))
