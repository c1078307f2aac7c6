"""Observations → InferenceService status, derived purely (the GPUPool's: ``pool_status``).

Conditions follow metav1.Condition. The five InferenceService conditions and what they promise
(docs/operator.md has the table):

- **Ready**: the current generation is applied, the Service behind ``status.url`` exists, and
  the service serves at the replica count its pool granted (from old and new pods together
  while a rollout with ``maxUnavailable: 0`` runs), or it is scaled to zero. Never True while
  Stalled.
- **Progressing** (Deployment-style, read by Argo CD) and **Reconciling** (kstatus) always
  agree: True while the operator still expects to reach the desired state by itself. A paused
  canary rollout waits for a person, so both are False (reason RolloutPaused) once the held
  step's replicas are up: kstatus reads Current, Argo CD Suspended.
- **Stalled** (kstatus): progress needs someone to act (a missing pool, a refused apply, a
  rollout past its deadline, pods that cannot start, nothing granted). Never True together
  with Reconciling.
- **Degraded**: something needs a human, including what does not stop the service (a quota
  cap, pods waiting for GPUs); every Stalled reason is also Degraded.

``observedGeneration`` is always the generation these conditions were computed for; kstatus
reads it with Reconciling and Stalled (Current, InProgress or Failed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ladle.api import JSON, InferenceService
from ladle.operator.adapter_status import AdaptersObservation
from ladle.operator.conditions import (
    DEGRADED,
    PROGRESSING,
    READY,
    RECONCILING,
    STALLED,
    Condition,
    merge_conditions,
)
from ladle.operator.pod_problems import (
    PodProblem,
    needs_someone,
    short_of_gpus,
)
from ladle.operator.rollout_state import RolloutState, to_status
from ladle.words import plural


def _scaled_to_zero(isvc: InferenceService) -> str:
    """How a service at zero will serve its next request, in so many words."""
    if isvc.spec.autoscaling is not None:
        return (
            "scaled to zero for lack of requests; the gateway holds the next one (up to "
            "spec.timeouts.scaleFromZeroSeconds) while the autoscaler starts a replica"
        )
    return (
        "scaled to zero replicas (spec.replicas is 0): the gateway holds each request up to "
        "spec.timeouts.scaleFromZeroSeconds for a ready replica, then answers 503 no_ready_pods; "
        "raise spec.replicas to serve"
    )


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
class VariantObservation:
    name: str
    quantization: str
    image: str
    deployment_name: str
    deployment: Mapping[str, Any] | None
    requested_replicas: int
    granted_replicas: int
    gpu_resource: str
    pod_problems: tuple[PodProblem, ...] = ()
    # Why granted < requested, in words, when a GPUPool quota caps this variant.
    quota_note: str | None = None
    # Its share of traffic (percent), and the revision it runs.
    weight: int = 100
    revision: str | None = None
    # What its runtime said refusing its settings: it stays at zero replicas.
    refused: str | None = None
    rollout: Rollout = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rollout", read_rollout(self.deployment, self.granted_replicas))


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str
    # It will not go away without someone acting (kstatus Stalled).
    stalls: bool = False


def _pod_problems(v: VariantObservation) -> list[Problem]:
    problems = []
    if v.refused is not None:
        problems.append(
            Problem(
                "SettingsRefused",
                f"the runtime of Deployment {v.deployment_name} refuses its settings: "
                f"{v.refused}; it stays at 0 replicas until the spec changes",
                stalls=True,
            )
        )
    unschedulable = [p for p in v.pod_problems if p.reason == "Unschedulable"]
    if unschedulable:
        first = unschedulable[0]
        insufficient = short_of_gpus([p.message for p in unschedulable], v.gpu_resource)
        problems.append(
            Problem(
                "InsufficientGPUs" if insufficient else "Unschedulable",
                f"{plural(len(unschedulable), 'pod')} of Deployment {v.deployment_name} "
                f"cannot be scheduled: {first.message}",
            )
        )
    waiting: dict[str, list[PodProblem]] = {}
    for p in v.pod_problems:
        if p.reason != "Unschedulable":
            waiting.setdefault(p.reason, []).append(p)
    for reason, pods in waiting.items():
        problems.append(
            Problem(
                reason,
                f"{plural(len(pods), 'pod')} of Deployment {v.deployment_name} cannot start: "
                f"{reason}: {pods[0].message}",
                stalls=needs_someone(reason, pods[0].message),
            )
        )
    return problems


def _progress(v: VariantObservation) -> str:
    r, want = v.rollout, v.granted_replicas
    if not r.exists:
        return f"{v.deployment_name}: not created yet"
    text = (
        f"{v.deployment_name}: {min(r.updated, want)}/{want} replicas updated, "
        f"{min(r.available, want)}/{want} available"
    )
    if r.replicas > want and r.updated >= want:
        # Extra pods once every replica is updated are leftovers (a hand scale, a grant cut);
        # before that they are the rolling update's surge.
        text += f"; scaling down from {r.replicas}"
    return text


def derive_isvc_status(
    isvc: InferenceService,
    variants: Sequence[VariantObservation],
    *,
    url: str,
    selector: str,
    now: str,
    previous: Mapping[str, Any] | None = None,
    blockers: Sequence[Problem] = (),
    service_exists: bool = True,
    service_error: str | None = None,
    rollout: RolloutState | None = None,
    adapters: AdaptersObservation | None = None,
) -> JSON:
    """Status of one InferenceService; ``previous`` (default: the stored status) keeps
    condition transition times.

    During a canary rollout, Ready is about the variants that take traffic (a canary still
    starting, or one being removed, does not make the service unready) and Progressing
    follows the rollout; after a rollback or a failed rollout, Degraded says which gate failed
    and with what numbers while stable serves (Ready stays True).

    ``blockers`` are why the current generation's children could not be applied (a missing
    GPUPool, someone else's object holding a child's name, a refused apply): the live children
    may still run an older generation, so nothing may read as Ready. ``service_error`` is why
    the last create of the Service failed."""
    problems: list[Problem] = list(blockers)
    if not service_exists and service_error:
        problems.append(
            Problem(
                "ServiceNotCreated",
                f"Service {isvc.meta.name} could not be created: {service_error}",
                stalls=True,
            )
        )
    traffic = [v for v in variants if v.weight > 0] or list(variants)
    for v in variants:
        found = _pod_problems(v)
        if v.rollout.stalled and found:
            # The deadline only says that time ran out; the pods' own reason says why, so it
            # stays the reason, and now stalls.
            first, *rest = found
            deadline = f"{first.message} (progress deadline exceeded: {v.rollout.stalled})"
            found = [replace(p, stalls=True) for p in [replace(first, message=deadline), *rest]]
        elif v.rollout.stalled:
            found.append(
                Problem(
                    "ProgressDeadlineExceeded",
                    f"{v.deployment_name}: {v.rollout.stalled}",
                    stalls=True,
                )
            )
        if v.rollout.failure:
            found.append(Problem("ReplicaFailure", f"{v.deployment_name}: {v.rollout.failure}"))
        if v not in traffic:
            # A variant without traffic stops nothing: the rollout holds on it instead.
            found = [replace(p, stalls=False) for p in found]
        problems.extend(found)
    if rollout is not None and rollout.failed_revision is not None and rollout.reason:
        # status.rollout.message starts with the reason, which the condition carries already.
        detail = rollout.message.removeprefix(f"{rollout.reason}: ")
        problems.insert(0, Problem(rollout.reason, detail))

    if adapters is not None and adapters.condition.reason == "AdapterLoadFailed":
        # The base model and the other adapters serve on: it degrades, it does not stall.
        problems.append(Problem("AdapterLoadFailed", adapters.condition.message))

    granted = sum(v.granted_replicas for v in traffic)
    requested = sum(v.requested_replicas for v in traffic)
    available = sum(v.rollout.available for v in traffic)
    updated = sum(v.rollout.updated for v in variants)
    complete = bool(variants) and all(v.rollout.complete for v in variants)
    canary = rollout is not None and (rollout.active or rollout.phase == "Paused")
    notes = [v.quota_note for v in variants if v.quota_note]
    if notes:
        problems.append(Problem("QuotaExceeded", "; ".join(notes), stalls=granted == 0))
    stall = next((p for p in problems if p.stalls), None)
    progress = ", ".join(_progress(v) for v in variants)
    service_pending = None if service_exists else f"Service {isvc.meta.name} is being created"

    blocker = blockers[0] if blockers else None
    if stall is not None:
        ready = Condition(READY, False, stall.reason, stall.message)
    elif blocker is not None:
        ready = Condition(READY, False, blocker.reason, blocker.message)
    elif service_pending:
        ready = Condition(READY, False, "ServiceNotCreated", service_pending)
    elif requested == 0:
        ready = Condition(READY, True, "ScaledToZero", _scaled_to_zero(isvc))
    elif available >= granted:
        serving = f"{available}/{granted} replicas available"
        if canary and rollout is not None:
            ready = Condition(
                READY, True, "RollingOut", f"serving {serving}; canary: {rollout.message}"
            )
        elif not complete:
            ready = Condition(
                READY, True, "RollingOut", f"serving {serving} while rolling out: {progress}"
            )
        elif granted < requested:
            ready = Condition(
                READY,
                True,
                "QuotaCapped",
                f"{serving}; the GPUPool quota allows {granted} of {requested} requested",
            )
        else:
            ready = Condition(READY, True, "Available", serving)
    else:
        pod_problem = next((p for p in problems if p.reason != "QuotaExceeded"), None)
        reason, message = (
            (pod_problem.reason, pod_problem.message) if pod_problem else ("RollingOut", progress)
        )
        ready = Condition(READY, False, reason, message)

    if stall is not None:
        progressing = Condition(PROGRESSING, False, stall.reason, stall.message)
    elif blocker is not None:  # a passing error: the work queue retries
        progressing = Condition(PROGRESSING, True, blocker.reason, blocker.message)
    elif service_pending:
        progressing = Condition(PROGRESSING, True, "CreatingService", service_pending)
    elif canary and rollout is not None and rollout.phase == "Paused":
        # It waits for a person (spec.rollout.paused, or a manual promotion), and paused time
        # never runs into a deadline: once the held step's replicas are up, nothing more will
        # happen by itself, so kstatus reads Current (Flux and `kubectl wait` stop waiting)
        # while Argo CD shows Suspended from status.rollout.phase.
        message = rollout.message if complete else f"{rollout.message}; {progress}"
        progressing = Condition(PROGRESSING, not complete, "RolloutPaused", message)
    elif canary and rollout is not None:
        progressing = Condition(PROGRESSING, True, "CanaryRollout", rollout.message)
    elif not complete:
        progressing = Condition(PROGRESSING, True, "RollingOut", progress)
    else:
        progressing = Condition(
            PROGRESSING, False, "RolloutComplete", f"{updated}/{granted} replicas up to date"
        )
    reconciling = Condition(
        RECONCILING, progressing.status, progressing.reason, progressing.message
    )
    stalled = (
        Condition(STALLED, True, stall.reason, "; ".join(p.message for p in problems if p.stalls))
        if stall is not None
        else Condition(STALLED, False, "AsExpected")
    )
    degraded = (
        Condition(DEGRADED, True, problems[0].reason, "; ".join(p.message for p in problems))
        if problems
        else Condition(DEGRADED, False, "AsExpected")
    )

    generation = isvc.meta.generation
    status: JSON = {
        "observedGeneration": generation,
        "replicas": sum(v.rollout.replicas for v in variants),
        "readyReplicas": sum(v.rollout.ready for v in variants),
        "availableReplicas": available,
        "updatedReplicas": updated,
        "selector": selector,
        "url": url,
        "conditions": merge_conditions(
            (isvc.status if previous is None else previous).get("conditions") or (),
            [
                ready,
                progressing,
                reconciling,
                stalled,
                degraded,
                *([adapters.condition] if adapters is not None else []),
            ],
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
                "weight": v.weight,
                **({"revision": v.revision} if v.revision else {}),
            }
            for v in variants
        ],
    }
    if rollout is not None:
        status["rollout"] = to_status(rollout)
    if adapters is not None:
        status["adapters"] = adapters.status()
    return status
