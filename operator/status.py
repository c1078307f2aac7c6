"""Children → status: pure derivation of InferenceService and GPUPool status.

Conditions follow metav1.Condition and the Ready/Progressing/Degraded trio that Argo CD reads:
Ready means the desired state is reached, Progressing means a rollout is under way, Degraded
means something needs a human (with the reason and the scheduler's own words). kstatus (Flux,
kpt) reads Reconciling and Stalled: Reconciling always agrees with Progressing, and Stalled says
that progress needs someone to act (a missing pool, someone else's object in the way, a rollout
past its deadline, a Service the API server refuses, nothing granted); never both True.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ladle.operator.api import JSON, GPUPool, GPUPoolSpec, InferenceService
from ladle.operator.quantity import quantity_to_int
from ladle.operator.quota import PoolPlan

READY = "Ready"
PROGRESSING = "Progressing"
RECONCILING = "Reconciling"
STALLED = "Stalled"
DEGRADED = "Degraded"
OPERATOR_CONDITIONS = frozenset({READY, PROGRESSING, RECONCILING, STALLED, DEGRADED})
# status.gateway, and any condition of another type (the gateway's ModelNameConflict), belong
# to the gateway's field manager: the operator never writes them and compares its own status
# without them, so a gateway's write never makes the operator write.
GATEWAY_STATUS = "gateway"
# What a scaled-to-zero service does with the next request, in words.
SCALED_TO_ZERO_MESSAGE = (
    "scaled to zero replicas (spec.replicas is 0): the gateway holds each request up to "
    "spec.timeouts.scaleFromZeroSeconds for a ready replica, then answers 503 no_ready_pods; "
    "raise spec.replicas to serve"
)


def operator_status(status: Mapping[str, Any]) -> JSON:
    """The part of a stored status that the operator writes."""
    own = {k: v for k, v in status.items() if k != GATEWAY_STATUS}
    if "conditions" in own:
        own["conditions"] = [c for c in own["conditions"] if c.get("type") in OPERATOR_CONDITIONS]
    return own


@dataclass(frozen=True)
class Condition:
    type: str
    status: bool
    reason: str
    message: str = ""


def merge_conditions(
    previous: Sequence[Mapping[str, Any]],
    current: Sequence[Condition],
    generation: int,
    now: str,
) -> list[JSON]:
    """Render conditions, keeping lastTransitionTime while a condition's status holds."""
    before = {c.get("type"): c for c in previous}
    out: list[JSON] = []
    for cond in current:
        status = "True" if cond.status else "False"
        old = before.get(cond.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        out.append(
            {
                "type": cond.type,
                "status": status,
                "reason": cond.reason,
                "message": cond.message,
                "lastTransitionTime": since or now,
                "observedGeneration": generation,
            }
        )
    return out


@dataclass(frozen=True)
class Rollout:
    """What a Deployment says about reaching ``want`` replicas of its current template."""

    exists: bool
    replicas: int = 0
    updated: int = 0
    ready: int = 0
    available: int = 0
    complete: bool = False
    stalled: str | None = None
    failure: str | None = None


def read_rollout(deployment: Mapping[str, Any] | None, want: int) -> Rollout:
    if deployment is None:
        return Rollout(exists=False)
    meta = deployment.get("metadata") or {}
    spec = deployment.get("spec") or {}
    st = deployment.get("status") or {}
    replicas = int(st.get("replicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    ready = int(st.get("readyReplicas") or 0)
    available = int(st.get("availableReplicas") or 0)
    observed = int(st.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
    complete = (
        observed
        and int(spec.get("replicas", 1)) == want
        and updated == want
        and replicas == want
        and available == want
    )
    stalled = failure = None
    for cond in st.get("conditions") or ():
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            stalled = str(cond.get("message") or "progress deadline exceeded")
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = str(cond.get("message") or cond.get("reason") or "replica failure")
    return Rollout(True, replicas, updated, ready, available, complete, stalled, failure)


@dataclass(frozen=True)
class UnschedulablePod:
    name: str
    # The scheduler's FailedScheduling event message (or the pod condition's, as a fallback).
    message: str


@dataclass(frozen=True)
class VariantObservation:
    name: str
    quantization: str
    image: str
    deployment_name: str
    deployment: Mapping[str, Any] | None
    requested_replicas: int
    granted_replicas: int
    gpu_resource: str
    unschedulable: tuple[UnschedulablePod, ...] = ()
    # Why granted < requested, in words, when a GPUPool quota caps this variant.
    quota_note: str | None = None
    rollout: Rollout = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rollout", read_rollout(self.deployment, self.granted_replicas))


def _scheduling_problem(v: VariantObservation) -> tuple[str, str] | None:
    if not v.unschedulable:
        return None
    first = v.unschedulable[0]
    insufficient = any(f"Insufficient {v.gpu_resource}" in p.message for p in v.unschedulable)
    reason = "InsufficientGPUs" if insufficient else "Unschedulable"
    count = len(v.unschedulable)
    pods = "pod" if count == 1 else "pods"
    return reason, (
        f"{count} {pods} of Deployment {v.deployment_name} cannot be scheduled: {first.message}"
    )


def derive_isvc_status(
    isvc: InferenceService,
    variants: Sequence[VariantObservation],
    *,
    url: str,
    selector: str,
    now: str,
    previous: Mapping[str, Any] | None = None,
    pool_problem: str | None = None,
    service_exists: bool = True,
    service_error: str | None = None,
    conflict: str | None = None,
) -> JSON:
    """Status of one InferenceService; ``previous`` (default: the stored status) keeps
    condition transition times.

    Ready promises a working URL, so it also waits for the Service behind ``url``;
    ``service_error`` is why its last create failed. ``conflict`` names a child that could not
    be applied because someone else's object holds its name."""
    service_pending = None
    if not service_exists:
        service_pending = f"Service {isvc.meta.name} " + (
            f"could not be created: {service_error}" if service_error else "is being created"
        )
    problems: list[tuple[str, str]] = []
    if pool_problem:
        problems.append(("GPUPoolNotFound", pool_problem))
    if conflict:
        problems.append(("ChildConflict", conflict))
    for v in variants:
        sched = _scheduling_problem(v)
        if sched:
            problems.append(sched)
        if v.rollout.stalled:
            problems.append(
                ("ProgressDeadlineExceeded", f"{v.deployment_name}: {v.rollout.stalled}")
            )
        if v.rollout.failure:
            problems.append(("ReplicaFailure", f"{v.deployment_name}: {v.rollout.failure}"))
    if service_pending and service_error:
        problems.append(("ServiceNotCreated", service_pending))
    blocking = problems[0] if problems else None
    for v in variants:
        if v.quota_note:
            problems.append(("QuotaExceeded", v.quota_note))

    granted = sum(v.granted_replicas for v in variants)
    requested = sum(v.requested_replicas for v in variants)
    if blocking is None and granted == 0 < requested:
        # Nothing may run at all: that, not the rollout, is why the service is not ready.
        blocking = next((p for p in problems if p[0] == "QuotaExceeded"), None)
    available = sum(v.rollout.available for v in variants)
    updated = sum(v.rollout.updated for v in variants)
    complete = all(v.rollout.complete for v in variants) and bool(variants)
    stalled = next((v for v in variants if v.rollout.stalled), None)

    if complete and service_pending:
        ready = Condition(READY, False, "ServiceNotCreated", service_pending)
        progressing = Condition(PROGRESSING, True, "CreatingService", service_pending)
    elif complete:
        capped = (
            f" (quota allows {granted} of {requested} requested)" if granted < requested else ""
        )
        if granted > 0:
            ready = Condition(
                READY, True, "Available", f"{available}/{granted} replicas available{capped}"
            )
        elif requested > 0:
            note = next((v.quota_note for v in variants if v.quota_note), "no replicas granted")
            ready = Condition(READY, False, "QuotaExceeded", note)
        else:
            ready = Condition(READY, True, "ScaledToZero", SCALED_TO_ZERO_MESSAGE)
        progressing = Condition(
            PROGRESSING, False, "RolloutComplete", f"{updated}/{granted} replicas up to date"
        )
    else:
        waiting = ", ".join(
            f"{v.deployment_name}: {v.rollout.updated}/{v.granted_replicas} updated, "
            f"{v.rollout.available} available"
            if v.rollout.exists
            else f"{v.deployment_name}: not created yet"
            for v in variants
        )
        reason, message = blocking if blocking else ("RollingOut", waiting)
        ready = Condition(READY, False, reason, message)
        if stalled is not None:
            progressing = Condition(
                PROGRESSING, False, "ProgressDeadlineExceeded", str(stalled.rollout.stalled)
            )
        elif pool_problem and not any(v.rollout.exists for v in variants):
            progressing = Condition(PROGRESSING, False, "GPUPoolNotFound", pool_problem)
        else:
            progressing = Condition(PROGRESSING, True, "RollingOut", waiting)
    stalls = [
        (reason, message)
        for reason, message in problems
        if reason in ("GPUPoolNotFound", "ChildConflict", "ProgressDeadlineExceeded")
        or (reason == "ServiceNotCreated" and service_error)
        or (reason == "QuotaExceeded" and granted == 0 < requested)
    ]
    if stalls:
        progressing = Condition(PROGRESSING, False, *stalls[0])
    reconciling = Condition(
        RECONCILING, progressing.status, progressing.reason, progressing.message
    )
    stall = (
        Condition(STALLED, True, stalls[0][0], "; ".join(m for _, m in stalls))
        if stalls
        else Condition(STALLED, False, "AsExpected")
    )
    degraded = (
        Condition(DEGRADED, True, problems[0][0], "; ".join(m for _, m in problems))
        if problems
        else Condition(DEGRADED, False, "AsExpected")
    )
    generation = isvc.meta.generation
    return {
        "observedGeneration": generation,
        "replicas": sum(v.rollout.replicas for v in variants),
        "readyReplicas": sum(v.rollout.ready for v in variants),
        "availableReplicas": available,
        "updatedReplicas": updated,
        "selector": selector,
        "url": url,
        "conditions": merge_conditions(
            (isvc.status if previous is None else previous).get("conditions") or (),
            [ready, progressing, degraded, reconciling, stall],
            generation,
            now,
        ),
        "variants": [
            {
                "name": v.name,
                "quantization": v.quantization,
                "image": v.image,
                "deployment": v.deployment_name,
                "requestedReplicas": v.requested_replicas,
                "desiredReplicas": v.granted_replicas,
                "replicas": v.rollout.replicas,
                "readyReplicas": v.rollout.ready,
                "availableReplicas": v.rollout.available,
                "updatedReplicas": v.rollout.updated,
            }
            for v in variants
        ],
    }


@dataclass(frozen=True)
class NodeInfo:
    """The parts of a Node that pool accounting reads (kept small: nodes heartbeat often)."""

    name: str
    labels: Mapping[str, str]
    ready: bool
    unschedulable: bool
    capacity: Mapping[str, str]
    allocatable: Mapping[str, str]

    @classmethod
    def from_node(cls, node: Mapping[str, Any]) -> NodeInfo:
        meta = node.get("metadata") or {}
        status = node.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
        return cls(
            name=str(meta.get("name")),
            labels=dict(meta.get("labels") or {}),
            ready=ready,
            unschedulable=bool((node.get("spec") or {}).get("unschedulable")),
            capacity=dict(status.get("capacity") or {}),
            allocatable=dict(status.get("allocatable") or {}),
        )


def node_matches(pool: GPUPoolSpec, node: NodeInfo) -> bool:
    selector = pool.scheduling_selector()
    if any(node.labels.get(k) != v for k, v in selector.items()):
        return False
    return quantity_to_int(node.capacity.get(pool.resource_name, "0")) > 0


def derive_pool_status(
    pool: GPUPool,
    nodes: Sequence[NodeInfo],
    plan: PoolPlan[Any],
    services: int,
    now: str,
    previous: Mapping[str, Any] | None = None,
) -> JSON:
    resource = pool.spec.resource_name
    matching = [n for n in nodes if node_matches(pool.spec, n)]
    schedulable = [n for n in matching if n.ready and not n.unschedulable]
    capacity = sum(quantity_to_int(n.capacity.get(resource, "0")) for n in matching)
    allocatable = sum(quantity_to_int(n.allocatable.get(resource, "0")) for n in schedulable)

    if allocatable > 0:
        ready = Condition(
            READY,
            True,
            "NodesAvailable",
            f"{len(schedulable)} schedulable nodes offer {allocatable} {resource}",
        )
    elif matching:
        ready = Condition(
            READY,
            False,
            "NoSchedulableNodes",
            f"{len(matching)} nodes match but none is ready and schedulable",
        )
    else:
        ready = Condition(READY, False, "NoMatchingNodes", f"no node matches and offers {resource}")

    problems: list[tuple[str, str]] = []
    if plan.requested_gpus > plan.claimed_gpus:
        problems.append(
            (
                "QuotaExceeded",
                f"InferenceServices request {plan.requested_gpus} GPUs but the quota is "
                f"{plan.quota_gpus}; {plan.requested_gpus - plan.claimed_gpus} GPUs are withheld",
            )
        )
    if plan.claimed_gpus > allocatable:
        problems.append(
            (
                "OverCommitted",
                f"{plan.claimed_gpus} GPUs are claimed but only {allocatable} are allocatable",
            )
        )
    degraded = (
        Condition(DEGRADED, True, problems[0][0], "; ".join(m for _, m in problems))
        if problems
        else Condition(DEGRADED, False, "AsExpected")
    )
    generation = pool.meta.generation
    return {
        "observedGeneration": generation,
        "nodes": len(matching),
        "capacity": capacity,
        "allocatable": allocatable,
        "claimed": plan.claimed_gpus,
        "requested": plan.requested_gpus,
        "inferenceServices": services,
        "conditions": merge_conditions(
            (pool.status if previous is None else previous).get("conditions") or (),
            [ready, degraded],
            generation,
            now,
        ),
    }
