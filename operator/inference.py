"""The InferenceService reconciler: grant → variants → desired children → apply → status.

One reconcile recomputes everything from the store, whatever event caused it (level-based).
The pool grants replicas; ``desired.plan_variants`` splits them into variants (one today,
canaries tomorrow); each variant renders its children, the Service fronts them all; the
applier makes them so; and status is derived from what the store then holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ladle.operator.api import API_VERSION, ISVC_KIND, JSON, InferenceService
from ladle.operator.applier import ChildApplier, ChildConflict, Owner, SyncResult, child_key
from ladle.operator.config import OperatorConfig
from ladle.operator.desired import (
    desired_children,
    desired_service,
    label_selector,
    plan_variants,
    service_url,
    template_hash,
    variant_name,
)
from ladle.operator.events import ObjectRef, now_rfc3339
from ladle.operator.kube import ApiError, KubeClient, resource_path
from ladle.operator.pools import Grant, PoolReconciler
from ladle.operator.status import (
    ISVC_CONDITIONS,
    ISVC_STATUS_FIELDS,
    PodProblem,
    Problem,
    VariantObservation,
    derive_isvc_status,
)
from ladle.operator.status_writer import StatusWriter
from ladle.operator.store import PodInfo, Store
from ladle.operator.telemetry import Metrics

log = logging.getLogger("ladle.operator.inference")

IsvcKey = tuple[str, str]
# Children that come and go with the spec: deleted when no longer desired.
PRUNED_KINDS = ("ConfigMap", "PodDisruptionBudget")


def isvc_ref(isvc: InferenceService) -> ObjectRef:
    return ObjectRef(API_VERSION, ISVC_KIND, isvc.meta.namespace, isvc.meta.name, isvc.meta.uid)


def apply_problem(key: tuple[str, str, str], err: Exception) -> Problem:
    """A failed apply as a condition: someone else's object, a refusal, or a passing error."""
    if isinstance(err, ChildConflict):
        return Problem("ChildConflict", err.message, stalls=True)
    if isinstance(err, ApiError):
        refused = 400 <= err.status < 500 and err.status not in (409, 429)
        return Problem("ApplyFailed", f"{key[0]} {key[2]}: {err}", stalls=refused)
    return Problem("ApplyFailed", f"{key[0]} {key[2]}: {err}")


def surges(live: JSON | None) -> bool:
    """Whether a live Deployment rolls with a surge replica (a new one does)."""
    rolling = ((live or {}).get("spec") or {}).get("strategy") or {}
    return str((rolling.get("rollingUpdate") or {}).get("maxSurge", 1)) != "0"


def rolling_out(live: JSON | None, desired: JSON) -> bool:
    """A rollout of the Deployment is due (a new pod template) or still under way."""
    if live is None:
        return False
    status = live.get("status") or {}
    if int(status.get("updatedReplicas") or 0) < int(status.get("replicas") or 0):
        return True
    return template_hash(live) != template_hash(desired)


class InferenceServiceReconciler:
    def __init__(
        self,
        store: Store,
        client: KubeClient,
        applier: ChildApplier,
        pools: PoolReconciler,
        writer: StatusWriter,
        config: OperatorConfig,
        requeue: Callable[[IsvcKey, float], None],
        metrics: Metrics,
    ) -> None:
        self.store = store
        self.client = client
        self.applier = applier
        self.pools = pools
        self.writer = writer
        self.config = config
        self.requeue = requeue
        self.metrics = metrics

    def forget(self, key: IsvcKey, uid: str | None) -> None:
        self.metrics.forget_isvc(*key)
        if uid:
            self.applier.forget(uid)
            self.writer.forget(uid)
        self.pools.forget(key)

    def desired(self, isvc: InferenceService, grant: Grant, rolling: set[str]) -> list[JSON]:
        """Every child: each variant's, then the Service. A variant about to roll out gets the
        strategy its pool's headroom allows; the others keep the one they have, so that a
        strategy never changes (and bumps a Deployment) for nothing."""
        objects: list[JSON] = []
        for variant in plan_variants(isvc, grant.replicas):
            name = variant_name(isvc.meta.name, variant.name)
            live = self.store.get("Deployment", (isvc.meta.namespace, name))
            surge = grant.surge if variant.name in rolling else surges(live)
            children = desired_children(
                isvc, grant.pool, variant.replicas, self.config, variant.name, surge=surge
            )
            objects += children.all()
        return [*objects, desired_service(isvc)]

    def _rolling(self, isvc: InferenceService) -> set[str]:
        """The variants whose rollout is due or under way."""
        pool = self.store.get("GPUPool", ("", isvc.spec.gpu_pool)) if isvc.spec.gpu_pool else None
        rolling = set()
        for variant in plan_variants(isvc, isvc.requested_replicas):
            wanted = desired_children(
                isvc, pool.spec if pool else None, variant.replicas, self.config, variant.name
            ).deployment
            if rolling_out(self.store.get("Deployment", child_key(wanted)[1:]), wanted):
                rolling.add(variant.name)
        return rolling

    async def reconcile(self, key: IsvcKey) -> None:
        isvc: InferenceService | None = self.store.get(ISVC_KIND, key)
        if isvc is None:
            return
        if isvc.meta.deleting:
            return  # the garbage collector removes the children
        owner = Owner(isvc_ref(isvc), lambda delay: self.requeue(key, delay))
        rolling = self._rolling(isvc)
        grant = self.pools.grant(isvc, bool(rolling))
        blockers = [grant.blocker] if grant.blocker else []
        result = SyncResult()
        if grant.pool is not None or not isvc.spec.gpu_pool:
            desired = self.desired(isvc, grant, rolling)
            result = await self.applier.sync(owner, desired, PRUNED_KINDS)
        blockers += [apply_problem(k, err) for k, err in result.errors]

        service = child_key(desired_service(isvc))
        variants = [
            await self._observe(isvc, variant.name, variant.replicas, grant)
            for variant in plan_variants(isvc, grant.replicas)
        ]
        previous = self.writer.previous(
            isvc.meta.uid, isvc.status, ISVC_STATUS_FIELDS, ISVC_CONDITIONS
        )
        status = derive_isvc_status(
            isvc,
            variants,
            url=self.config.gateway_url or service_url(isvc, self.config.cluster_domain),
            selector=label_selector(isvc.meta.name),
            now=now_rfc3339(),
            previous=previous,
            blockers=blockers,
            service_exists=self.store.get("Service", service[1:]) is not None,
            service_error=result.create_errors.get(service),
        )
        self.metrics.observe_isvc(*key, status)
        await self.writer.write(owner.ref, status, previous)
        if result.errors:
            raise result.errors[0][1]  # the work queue retries with backoff

    async def _observe(
        self, isvc: InferenceService, variant: str, granted: int, grant: Grant
    ) -> VariantObservation:
        name = variant_name(isvc.meta.name, variant)
        pods: list[PodInfo] = [
            p for p in self.store.by_index("Pod", "owner", isvc.key) if p.variant == variant
        ]
        return VariantObservation(
            name=variant,
            quantization=isvc.spec.quantization.label(),
            image=isvc.spec.runtime_image or self.config.runtime_image,
            deployment_name=name,
            deployment=self.store.get("Deployment", (isvc.meta.namespace, name)),
            requested_replicas=isvc.requested_replicas,
            granted_replicas=granted,
            gpu_resource=grant.gpu_resource,
            pod_problems=tuple(await self._pod_problems(isvc.meta.namespace, pods)),
            quota_note=grant.note,
        )

    async def _pod_problems(self, namespace: str, pods: list[PodInfo]) -> list[PodProblem]:
        problems = [PodProblem(p.name, *p.problem) for p in pods if p.problem is not None]
        unschedulable = {p.pod for p in problems if p.reason == "Unschedulable"}
        if not unschedulable:
            return problems
        # The scheduler's FailedScheduling events carry its reasoning; the pod condition
        # holds the same text and stands in when events have expired.
        events = await self.client.list(
            resource_path("v1", "Event", namespace),
            {"fieldSelector": "involvedObject.kind=Pod,reason=FailedScheduling"},
        )
        latest: dict[str, tuple[str, str]] = {}
        for event in events:
            pod = str((event.get("involvedObject") or {}).get("name"))
            when = str(
                event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
            )
            if pod in unschedulable and (pod not in latest or when >= latest[pod][0]):
                latest[pod] = (when, str(event.get("message") or ""))
        return [
            PodProblem(p.pod, p.reason, latest[p.pod][1] or p.message) if p.pod in latest else p
            for p in problems
        ]
