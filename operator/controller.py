"""The reconcilers: watch caches → work queue → desired children → apply → status.

kopf delivers watch events; the handlers only update in-memory caches and queue keys, without
awaiting anything, so the caches change atomically. Workers then reconcile one key at a time
(level-based: every reconcile recomputes everything from the caches, whatever event caused it).
Decisions are pure functions in ``desired``, ``quota`` and ``status``; this module is the I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import kopf

from ladle.operator.api import (
    API_VERSION,
    GROUP,
    ISVC_KIND,
    ISVC_PLURAL,
    JSON,
    LABEL_ISVC,
    LABEL_VARIANT,
    MANAGED_SELECTOR,
    POOL_KIND,
    POOL_PLURAL,
    STABLE,
    VERSION,
    GPUPool,
    InferenceService,
    parse_isvc,
    parse_pool,
)
from ladle.operator.config import OperatorConfig
from ladle.operator.desired import (
    Children,
    config_map_name,
    desired_children,
    label_selector,
    object_digest,
    service_url,
    variant_name,
)
from ladle.operator.kube import REQUEST_ERRORS, ApiError, KubeClient, resource_path
from ladle.operator.quota import Claim, PoolPlan, plan_pool
from ladle.operator.status import (
    DEGRADED,
    PROGRESSING,
    READY,
    NodeInfo,
    UnschedulablePod,
    VariantObservation,
    derive_isvc_status,
    derive_pool_status,
    operator_status,
)
from ladle.operator.telemetry import Metrics
from ladle.operator.workqueue import WorkQueue

log = logging.getLogger("ladle.operator.controller")

IsvcKey = tuple[str, str]  # (namespace, name)
ChildKey = tuple[str, str, str]  # (kind, namespace, name)
# Kinds whose metadata.generation moves only when their spec does.
GENERATION_KINDS = frozenset({"Deployment", "PodDisruptionBudget"})
EVENT_POSTERS = 2
POOL_STATUS_INTERVAL = 1.0  # seconds
BACKGROUND_CREATES = 8


@dataclass(frozen=True)
class WorkKey:
    kind: Literal["isvc", "pool"]
    namespace: str
    name: str


@dataclass(frozen=True)
class Applied:
    """What the operator last applied to a child, to skip applies that would change nothing."""

    digest: str
    version: str


@dataclass(frozen=True)
class CreateFailure:
    """Why a background create of a child failed, and when to try it again.

    Its owner's reconciles succeed meanwhile, so the work queue's own backoff (reset by every
    successful reconcile) would retry a create that keeps failing at the base delay forever."""

    message: str
    failures: int
    retry_at: float  # time.monotonic()


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def child_version(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    if obj.get("kind") in GENERATION_KINDS:
        return str(meta.get("generation") or "")
    return str(meta.get("resourceVersion") or "")


def trim(obj: Mapping[str, Any]) -> JSON:
    """Keep what reconciles read; managedFields and pod templates would only cost memory."""
    meta = obj.get("metadata") or {}
    out: JSON = {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "generation", "resourceVersion", "labels")
            if key in meta
        },
    }
    if obj.get("kind") == "Deployment":
        out["spec"] = {"replicas": (obj.get("spec") or {}).get("replicas", 1)}
        out["status"] = obj.get("status") or {}
    return out


def _child_key(obj: Mapping[str, Any]) -> ChildKey:
    meta = obj["metadata"]
    return (str(obj["kind"]), str(meta["namespace"]), str(meta["name"]))


def _relevant(child: Mapping[str, Any]) -> object:
    """What a reconcile reads from a cached child: other changes need no reconcile."""
    meta = child.get("metadata") or {}
    if child.get("kind") == "Deployment":
        return (meta.get("generation"), child.get("spec"), child.get("status"))
    if child.get("kind") in GENERATION_KINDS:
        return meta.get("generation")
    return meta.get("resourceVersion")


def _unschedulable_message(pod: Mapping[str, Any]) -> str | None:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    if status.get("phase") not in (None, "Pending"):
        return None
    for cond in status.get("conditions") or ():
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return str(cond.get("message") or "unschedulable")
    return None


class Controller:
    def __init__(
        self,
        client: KubeClient,
        config: OperatorConfig,
        metrics: Metrics,
        *,
        identity: str = "ladle-operator",
        workers: int = 32,
        resync_seconds: float = 600.0,
    ) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        self.identity = identity
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.queue: WorkQueue[WorkKey] = WorkQueue(
            on_wait=lambda urgent, seconds: metrics.queue_wait.labels(
                "urgent" if urgent else "normal"
            ).observe(seconds)
        )
        self.isvcs: dict[IsvcKey, InferenceService] = {}
        self.pools: dict[str, GPUPool] = {}
        self.pool_members: dict[str, set[IsvcKey]] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.children: dict[ChildKey, JSON] = {}
        self.unschedulable: dict[IsvcKey, dict[str, tuple[str, str]]] = {}
        self.applied: dict[ChildKey, Applied] = {}
        self.grants: dict[IsvcKey, int] = {}
        # Each pool's last plan, dropped when a claim or the quota changes: every reconcile of
        # a member reads it, and recomputing it each time costs O(members) per reconcile.
        self.plans: dict[str, PoolPlan[IsvcKey]] = {}
        # The status last written per object (by uid), fresher than the watch cache.
        self.written_status: dict[str, JSON] = {}
        # Children changed or deleted by someone else, to say so in an Event once restored.
        self.drifted: dict[ChildKey, str] = {}
        self.pool_written_at: dict[str, float] = {}
        # Children being created in the background, and where to spawn such tasks.
        self.creating: dict[ChildKey, asyncio.Task[None]] = {}
        self.creating_slots = asyncio.Semaphore(BACKGROUND_CREATES)
        # The last background create of a child that failed, until one succeeds.
        self.create_failures: dict[ChildKey, CreateFailure] = {}
        self._group: asyncio.TaskGroup | None = None
        # Watch events seen per child, to tell whether an apply answer is the freshest state.
        self.watch_seq: dict[ChildKey, int] = {}
        self.deleted: set[ChildKey] = set()
        # Events are posted in the background: they must never slow a reconcile down.
        self.events: asyncio.Queue[JSON] = asyncio.Queue()

    # ---- observation: called from kopf's event handlers; no awaits, so caches stay coherent.

    def observe_isvc(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        old = self.isvcs.get(key)
        if event_type == "DELETED":
            self.isvcs.pop(key, None)
            if old is not None:
                self.written_status.pop(old.meta.uid, None)
        else:
            try:
                self.isvcs[key] = parse_isvc(obj)
            except (KeyError, TypeError, ValueError) as err:
                log.error("unreadable InferenceService", extra={"object": key, "error": str(err)})
                return
        new = self.isvcs.get(key)
        # Our own status writes come back as events too; only spec changes are urgent.
        spec_changed = (
            old is None
            or new is None
            or (old.meta.generation, old.meta.deleting) != (new.meta.generation, new.meta.deleting)
        )
        for pool in {i.spec.gpu_pool for i in (old, new) if i is not None and i.spec.gpu_pool}:
            members = self.pool_members.setdefault(pool, set())
            if new is not None and new.spec.gpu_pool == pool:
                members.add(key)
            else:
                members.discard(key)
            if spec_changed:
                self.plans.pop(pool, None)
                self.queue.add(WorkKey("pool", "", pool))
        if (
            not spec_changed
            and new is not None
            and operator_status(new.status) == self.written_status.get(new.meta.uid)
        ):
            return  # the echo of our own status write, or a gateway's (its fields only)
        self.queue.add(WorkKey("isvc", *key), urgent=spec_changed)

    def observe_pool(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        name = str((obj.get("metadata") or {}).get("name"))
        old = self.pools.get(name)
        if event_type == "DELETED":
            self.pools.pop(name, None)
            if old is not None:
                self.written_status.pop(old.meta.uid, None)
        else:
            self.pools[name] = parse_pool(obj)
        new = self.pools.get(name)
        self.queue.add(WorkKey("pool", "", name))
        if old is None or new is None or old.meta.generation != new.meta.generation:
            self.plans.pop(name, None)
            # Placement or quota changed: every member's pods and grants may change.
            for key in self.pool_members.get(name, ()):
                self.queue.add(WorkKey("isvc", *key), urgent=True)

    def observe_node(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        info = NodeInfo.from_node(obj)
        old = self.nodes.get(info.name)
        if event_type == "DELETED":
            self.nodes.pop(info.name, None)
        elif old == info:
            return  # a heartbeat: nothing pools care about changed
        else:
            self.nodes[info.name] = info
        for pool in self.pools:
            self.queue.add(WorkKey("pool", "", pool))

    def observe_child(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        namespace = str(meta.get("namespace"))
        key = (str(obj.get("kind")), namespace, str(meta.get("name")))
        owner = (meta.get("labels") or {}).get(LABEL_ISVC)
        self.watch_seq[key] = self.watch_seq.get(key, 0) + 1
        if event_type == "DELETED":
            self.children.pop(key, None)
            isvc = self.isvcs.get((namespace, str(owner)))
            if key in self.applied and isvc is not None and not isvc.meta.deleting:
                self.deleted.add(key)
        else:
            previous = self.children.get(key)
            self.children[key] = trim(obj)
            record = self.applied.get(key)
            version = child_version(obj)
            if (
                record is not None
                and key[0] in GENERATION_KINDS
                and version.isdigit()
                and record.version.isdigit()
                and int(version) > int(record.version)
            ):
                self.drifted[key] = version
            if previous is not None and _relevant(previous) == _relevant(self.children[key]):
                return  # a PDB's status, the Deployment's revision annotation, ...
        if owner:
            self.queue.add(WorkKey("isvc", namespace, str(owner)))

    def observe_pod(self, event_type: str | None, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        owner = labels.get(LABEL_ISVC)
        if not owner:
            return
        key = (str(meta.get("namespace")), str(owner))
        pod = str(meta.get("name"))
        message = None if event_type == "DELETED" else _unschedulable_message(obj)
        pods = self.unschedulable.setdefault(key, {})
        before = pods.get(pod)
        if message is None:
            pods.pop(pod, None)
            if not pods:
                self.unschedulable.pop(key, None)
        else:
            pods[pod] = (str(labels.get(LABEL_VARIANT, STABLE)), message)
        if (before and before[1]) != message:
            self.queue.add(WorkKey("isvc", *key))

    # ---- running

    async def prime(self) -> None:
        """Fill the caches before the first reconcile, so quota plans see every claim and a
        new leader does not report an existing Service as missing (Ready needs it)."""
        isvcs = await self.client.list(f"/apis/{GROUP}/{VERSION}/{ISVC_PLURAL}")
        pools = await self.client.list(f"/apis/{GROUP}/{VERSION}/{POOL_PLURAL}")
        nodes = await self.client.list("/api/v1/nodes")
        managed = {"labelSelector": MANAGED_SELECTOR}
        deployments = await self.client.list("/apis/apps/v1/deployments", managed)
        services = await self.client.list("/api/v1/services", managed)
        for obj in pools:
            self.observe_pool("ADDED", {**obj, "kind": POOL_KIND})
        for obj in nodes:
            self.observe_node("ADDED", obj)
        for obj in deployments:
            self.observe_child("ADDED", {**obj, "kind": "Deployment"})
        for obj in services:
            self.observe_child("ADDED", {**obj, "kind": "Service"})
        for obj in isvcs:
            self.observe_isvc("ADDED", obj)
        log.info(
            "caches primed",
            extra={"inferenceservices": len(isvcs), "gpupools": len(pools), "nodes": len(nodes)},
        )

    async def run(self) -> None:
        """Reconcile forever (until cancelled)."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            # A quarter of the workers wait for spec changes only.
            reserved = max(1, self.workers // 4)
            for index in range(self.workers):
                group.create_task(
                    self._worker(urgent_only=index < reserved), name=f"reconcile-worker-{index}"
                )
            group.create_task(self._resync(), name="resync")
            for index in range(EVENT_POSTERS):
                group.create_task(self._post_events(), name=f"event-poster-{index}")

    async def _resync(self) -> None:
        # Watches catch drift as it happens; this is the safety net for missed events.
        while True:
            await asyncio.sleep(self.resync_seconds)
            for key in list(self.isvcs):
                self.queue.add(WorkKey("isvc", *key))
            for name in list(self.pools):
                self.queue.add(WorkKey("pool", "", name))

    async def _worker(self, urgent_only: bool) -> None:
        while True:
            key = await self.queue.get(urgent_only)
            self.metrics.queue_depth.set(len(self.queue))
            started = time.perf_counter()
            try:
                if key.kind == "isvc":
                    await self.reconcile_isvc((key.namespace, key.name))
                else:
                    await self.reconcile_pool(key.name)
            except REQUEST_ERRORS as err:
                delay = self.queue.retry(key)
                self.metrics.errors.labels(key.kind).inc()
                self.metrics.reconciles.labels(key.kind, "error").inc()
                # In a namespace being deleted, nothing can be created until our object goes.
                closing = isinstance(err, ApiError) and "being terminated" in err.message
                log.log(
                    logging.INFO if closing else logging.WARNING,
                    "reconcile failed; will retry",
                    extra={
                        "object": f"{key.namespace}/{key.name}",
                        "kind": key.kind,
                        "error": str(err),
                        "retry_in_seconds": delay,
                    },
                )
            except Exception:
                delay = self.queue.retry(key)
                self.metrics.errors.labels(key.kind).inc()
                self.metrics.reconciles.labels(key.kind, "error").inc()
                log.exception(
                    "reconcile crashed; will retry",
                    extra={"object": f"{key.namespace}/{key.name}", "retry_in_seconds": delay},
                )
            else:
                self.queue.forget(key)
                self.metrics.reconciles.labels(key.kind, "ok").inc()
            finally:
                self.metrics.duration.labels(key.kind).observe(time.perf_counter() - started)
                self.queue.done(key)

    # ---- quota

    def _current_replicas(self, key: IsvcKey) -> int:
        if key in self.grants:
            return self.grants[key]
        live = self.children.get(("Deployment", key[0], variant_name(key[1], STABLE)))
        return int(((live or {}).get("spec") or {}).get("replicas") or 0)

    def plan(self, pool_name: str, reconciling: IsvcKey | None = None) -> PoolPlan[IsvcKey]:
        """Plan the pool and record the grants at once (no await: concurrent plans agree).

        Members whose grant changed are queued, except the one being reconciled right now.
        An unchanged pool keeps its plan: replanning with the grants as current replicas gives
        the same grants back."""
        cached = self.plans.get(pool_name)
        if cached is not None:
            return cached
        pool = self.pools.get(pool_name)
        claims = [
            Claim(
                key=key,
                created=isvc.meta.created,
                requested_replicas=isvc.spec.replicas,
                gpus_per_replica=isvc.spec.resources.gpus,
                current_replicas=self._current_replicas(key),
            )
            for key in sorted(self.pool_members.get(pool_name, ()))
            if (isvc := self.isvcs.get(key)) is not None and not isvc.meta.deleting
        ]
        plan = plan_pool(pool.spec.quota_gpus if pool else None, claims)
        for key, granted in plan.granted.items():
            if self.grants.get(key) != granted:
                self.grants[key] = granted
                if key != reconciling:
                    self.queue.add(WorkKey("isvc", *key))
        self.plans[pool_name] = plan
        return plan

    # ---- InferenceService

    async def reconcile_isvc(self, key: IsvcKey) -> None:
        isvc = self.isvcs.get(key)
        if isvc is None:
            self._forget_isvc(key)
            return
        if isvc.meta.deleting:
            return  # the garbage collector removes the children
        pool: GPUPool | None = None
        pool_problem = None
        quota_note = None
        granted = isvc.spec.replicas
        pool_name = isvc.spec.gpu_pool
        if pool_name:
            pool = self.pools.get(pool_name)
            if pool is None:
                pool_problem = f'GPUPool "{pool_name}" does not exist'
            else:
                plan = self.plan(pool_name, reconciling=key)
                granted = self.grants[key]
                self.queue.add(WorkKey("pool", "", pool_name))
                if granted < isvc.spec.replicas:
                    quota_note = (
                        f"GPUPool {pool_name} quota of {plan.quota_gpus} GPUs allows "
                        f"{granted} of {isvc.spec.replicas} replicas "
                        f"({plan.claimed_gpus} GPUs claimed, {plan.requested_gpus} requested)"
                    )
        else:
            self.grants[key] = granted

        namespace, name = key
        deployment_key = ("Deployment", namespace, variant_name(name, STABLE))
        conflict: ApiError | None = None
        if pool_problem is None:
            children = desired_children(
                isvc, pool.spec if pool else None, granted, self.config, STABLE
            )
            try:
                await self._apply_children(isvc, children)
            except ApiError as err:
                if err.status != 409:
                    raise
                conflict = err  # someone else's object has a child's name: say so, then retry
        deployment = self.children.get(deployment_key)

        unschedulable = await self._unschedulable_pods(key)
        image = isvc.spec.runtime_image or self.config.runtime_image
        variant = VariantObservation(
            name=STABLE,
            quantization=isvc.spec.quantization,
            image=image,
            deployment_name=deployment_key[2],
            deployment=deployment,
            requested_replicas=isvc.spec.replicas,
            granted_replicas=granted,
            gpu_resource=pool.spec.resource_name if pool else self.config.default_gpu_resource,
            unschedulable=tuple(unschedulable),
            quota_note=quota_note,
        )
        service_key = ("Service", namespace, name)
        failure = self.create_failures.get(service_key)
        previous = self.written_status.get(isvc.meta.uid) or operator_status(isvc.status)
        status = derive_isvc_status(
            isvc,
            [variant],
            url=self.config.gateway_url or service_url(isvc, self.config.cluster_domain),
            selector=label_selector(name),
            now=now_rfc3339(),
            previous=previous,
            pool_problem=pool_problem,
            service_exists=service_key in self.children,
            service_error=failure.message if failure else None,
            conflict=conflict.message if conflict else None,
        )
        self.metrics.observe_isvc(namespace, name, status)
        if status != previous:
            await self._write_status(isvc, status, previous)
        if conflict is not None:
            raise conflict  # the work queue retries with backoff until the name is free

    async def _apply_children(self, isvc: InferenceService, children: Children) -> None:
        if children.config_map is not None:  # before the pods that mount it
            await self._ensure(isvc, children.config_map)
        inline = []
        for child in children.all():
            if child is children.config_map:
                continue
            if child["kind"] == "Service" and _child_key(child) not in self.children:
                self._create_in_background(isvc, child)
            else:
                inline.append(child)
        await asyncio.gather(*(self._ensure(isvc, child) for child in inline))
        for kind, name in children.absent():
            key = (kind, isvc.meta.namespace, name)
            if key in self.children or key in self.applied:
                api_version = "v1" if kind == "ConfigMap" else "policy/v1"
                await self.client.delete(
                    resource_path(api_version, kind, isvc.meta.namespace, name)
                )
                self.applied.pop(key, None)
                self.deleted.discard(key)

    def _create_in_background(self, isvc: InferenceService, service: JSON) -> None:
        """Create a Service without holding up the reconcile.

        The API server allocates ClusterIPs one at a time; under load a Service create takes
        seconds, and a worker waiting on it would delay other InferenceServices' Deployments.
        The owner goes back to the queue when the create is done, whether it worked or not.
        """
        key = _child_key(service)
        if key in self.creating or self._group is None:
            return
        owner = WorkKey("isvc", isvc.meta.namespace, isvc.meta.name)
        failure = self.create_failures.get(key)
        if failure is not None and time.monotonic() < failure.retry_at:
            # Any event of the owner cancels a pending retry; so each reconcile sets it again.
            self.queue.add_after(owner, failure.retry_at - time.monotonic())
            return

        async def create() -> None:
            try:
                async with self.creating_slots:  # a storm of creates only slows each one down
                    await self._ensure(isvc, service)
                self.create_failures.pop(key, None)
            except REQUEST_ERRORS as err:
                failures = failure.failures + 1 if failure is not None else 1
                delay = self.queue.backoff(failures)
                log.warning(
                    "could not create a Service; will retry",
                    extra={"child": "/".join(key), "error": str(err), "retry_in": delay},
                )
                self.create_failures[key] = CreateFailure(
                    str(err), failures, time.monotonic() + delay
                )
            finally:
                self.creating.pop(key, None)
                # Its status says Ready, or why not; a failure also arms the retry. (The new
                # Service's watch event would not do: _ensure caches the object first.)
                self.queue.add(owner)

        self.creating[key] = self._group.create_task(create(), name=f"create-{'/'.join(key)}")

    async def _ensure(self, isvc: InferenceService, obj: JSON) -> JSON | None:
        """Apply one child unless the live object is exactly what we last applied."""
        key = _child_key(obj)
        digest = object_digest(obj)
        record = self.applied.get(key)
        live = self.children.get(key)
        if (
            record is not None
            and live is not None
            and record.digest == digest
            and child_version(live) == record.version
        ):
            return None
        if live is None and key in self.deleted and not await self._still_owned(isvc):
            return None
        if record is None:
            why = "new"
        elif record.digest != digest:
            why = "spec changed"
        elif live is None:
            why = "deleted"
        else:
            why = "changed by someone else"
        log.debug("applying", extra={"child": "/".join(key), "why": why})
        seq = self.watch_seq.get(key, 0)
        # Never take over an object we have not seen: one of the same name that someone else
        # made (a user's Service "chat", say) answers 409 instead of being overwritten.
        force = record is not None or live is not None
        try:
            result = await self.client.apply(obj, force=force)
        except ApiError as err:
            if err.status != 409 or force:
                raise
            raise ApiError(
                409, f"{key[0]} {key[2]} exists and is not ours: {err.message}", err.reason
            ) from err
        self.metrics.applies.labels(key[0]).inc()
        self.applied[key] = Applied(digest, child_version(result))
        if self.watch_seq.get(key, 0) == seq:
            # The answer is fresher than the cache, so status need not wait for the watch. If
            # an event arrived meanwhile, it may be newer still: then the watch has the say.
            self.children[key] = trim(result)
        if key in self.deleted:
            self.deleted.discard(key)
            self.emit(
                isvc,
                "Normal",
                "Restored",
                f"Recreated {key[0]} {key[2]}, which was deleted outside the operator",
            )
        seen = self.drifted.pop(key, None)
        if seen is not None and child_version(result) != seen:
            self.emit(
                isvc,
                "Normal",
                "Reverted",
                f"Reverted changes made to {key[0]} {key[2]} outside the operator",
            )
        return result

    async def _still_owned(self, isvc: InferenceService) -> bool:
        """Before recreating a deleted child, check the owner was not deleted meanwhile."""
        fresh = await self.client.get(
            resource_path(API_VERSION, ISVC_KIND, isvc.meta.namespace, isvc.meta.name)
        )
        meta = (fresh or {}).get("metadata") or {}
        return meta.get("uid") == isvc.meta.uid and not meta.get("deletionTimestamp")

    async def _unschedulable_pods(self, key: IsvcKey) -> list[UnschedulablePod]:
        pods = self.unschedulable.get(key)
        if not pods:
            return []
        # The scheduler's FailedScheduling events carry its reasoning; the pod condition
        # holds the same text and stands in when events have expired.
        events = await self.client.list(
            resource_path("v1", "Event", key[0]),
            {"fieldSelector": "involvedObject.kind=Pod,reason=FailedScheduling"},
        )
        latest: dict[str, tuple[str, str]] = {}
        for event in events:
            pod = str((event.get("involvedObject") or {}).get("name"))
            when = str(
                event.get("lastTimestamp") or event.get("eventTime") or event.get("firstTimestamp")
            )
            if pod in pods and (pod not in latest or when >= latest[pod][0]):
                latest[pod] = (when, str(event.get("message") or ""))
        return [
            UnschedulablePod(pod, latest.get(pod, ("", message))[1] or message)
            for pod, (_, message) in sorted(pods.items())
        ]

    async def _write_status(
        self, obj: InferenceService | GPUPool, status: JSON, previous: Mapping[str, Any]
    ) -> None:
        """Server-side apply the status subresource, then announce condition transitions."""
        kind = ISVC_KIND if isinstance(obj, InferenceService) else POOL_KIND
        metadata = {"name": obj.meta.name}
        if obj.meta.namespace:
            metadata["namespace"] = obj.meta.namespace
        body = {"apiVersion": API_VERSION, "kind": kind, "metadata": metadata, "status": status}
        try:
            await self.client.apply(body, subresource="status")
        except ApiError as err:
            if err.status == 404:
                return  # deleted meanwhile
            raise
        self.written_status[obj.meta.uid] = status
        old = {c.get("type"): c for c in previous.get("conditions") or ()}
        for cond in status["conditions"]:
            prior = old.get(cond["type"]) or {}
            if (prior.get("status"), prior.get("reason")) == (cond["status"], cond["reason"]):
                continue
            type_, on = cond["type"], cond["status"] == "True"
            if type_ == READY and on:
                self.emit(obj, "Normal", "Ready", cond["message"])
            elif type_ == PROGRESSING and on and old:
                # Not on creation: "it started" says nothing that Ready will not say.
                self.emit(obj, "Normal", "RollingOut", cond["message"])
            elif type_ == DEGRADED and on:
                self.emit(obj, "Warning", cond["reason"], cond["message"])
            elif type_ == DEGRADED and prior.get("status") == "True":
                self.emit(obj, "Normal", "Recovered", "No longer degraded")

    def _forget_isvc(self, key: IsvcKey) -> None:
        namespace, name = key
        self.metrics.forget_isvc(namespace, name)
        self.grants.pop(key, None)
        self.unschedulable.pop(key, None)
        for kind, child in (
            ("Deployment", variant_name(name, STABLE)),
            ("PodDisruptionBudget", variant_name(name, STABLE)),
            ("Service", name),
            ("ConfigMap", config_map_name(name, STABLE)),
        ):
            self.create_failures.pop((kind, namespace, child), None)
            self.applied.pop((kind, namespace, child), None)
            self.watch_seq.pop((kind, namespace, child), None)
            self.drifted.pop((kind, namespace, child), None)
            self.deleted.discard((kind, namespace, child))
        for pool, members in self.pool_members.items():
            if key in members:
                members.discard(key)
            # Freed GPUs may let others in the pool grow.
            self.plans.pop(pool, None)
            self.queue.add(WorkKey("pool", "", pool))
            self.plan(pool)

    # ---- GPUPool

    async def reconcile_pool(self, name: str) -> None:
        pool = self.pools.get(name)
        if pool is None:
            self.metrics.forget_pool(name)
            return
        plan = self.plan(name)
        services = len(self.pool_members.get(name, ()))
        previous = self.written_status.get(pool.meta.uid) or pool.status
        status = derive_pool_status(
            pool, list(self.nodes.values()), plan, services, now_rfc3339(), previous
        )
        self.metrics.observe_pool(name, status, pool.spec.quota_gpus)
        if status == previous:
            return
        # A pool's counts move with every member: write them at most once a second.
        wait = self.pool_written_at.get(name, -POOL_STATUS_INTERVAL) + POOL_STATUS_INTERVAL
        if time.monotonic() < wait:
            self.queue.add_after(WorkKey("pool", "", name), wait - time.monotonic())
            return
        await self._write_status(pool, status, previous)
        self.pool_written_at[name] = time.monotonic()

    # ---- events

    def emit(self, obj: InferenceService | GPUPool, type_: str, reason: str, message: str) -> None:
        """Log and queue a core/v1 Event about ``obj``."""
        kind = ISVC_KIND if isinstance(obj, InferenceService) else POOL_KIND
        namespace = obj.meta.namespace or "default"
        now = now_rfc3339()
        self.events.put_nowait(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{obj.meta.name}.", "namespace": namespace},
                "involvedObject": {
                    "apiVersion": API_VERSION,
                    "kind": kind,
                    "name": obj.meta.name,
                    "uid": obj.meta.uid,
                    **({"namespace": obj.meta.namespace} if obj.meta.namespace else {}),
                },
                "type": type_,
                "reason": reason,
                "message": message[:1024],
                "source": {"component": "ladle-operator"},
                "reportingComponent": f"{GROUP}/operator",
                "reportingInstance": self.identity,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
        )
        log.info(
            message,
            extra={"event": reason, "type": type_, "object": f"{namespace}/{obj.meta.name}"},
        )

    async def _post_events(self) -> None:
        """Post queued Events; one that cannot be posted is logged and dropped."""
        while True:
            event = await self.events.get()
            namespace = event["metadata"]["namespace"]
            try:
                await self.client.create(resource_path("v1", "Event", namespace), event)
                self.metrics.events.labels(event["type"], event["reason"]).inc()
            except REQUEST_ERRORS as err:
                log.warning(
                    "could not post event", extra={"reason": event["reason"], "error": str(err)}
                )


def build_registry(
    controller: Controller, login_fn: Callable[[], kopf.ConnectionInfo]
) -> kopf.OperatorRegistry:
    """kopf handlers that feed the controller's caches; one registry per leadership term."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        return login_fn()

    def feed(fn: Any) -> Any:
        async def handler(event: Mapping[str, Any], **_: Any) -> None:
            fn(event.get("type"), event["object"])

        return handler

    kopf.on.event(GROUP, VERSION, ISVC_PLURAL, registry=registry)(feed(controller.observe_isvc))
    kopf.on.event(GROUP, VERSION, POOL_PLURAL, registry=registry)(feed(controller.observe_pool))
    kopf.on.event("v1", "nodes", registry=registry)(feed(controller.observe_node))
    kopf.on.event("v1", "pods", registry=registry)(feed(controller.observe_pod))
    for group_version, plural in (
        ("apps/v1", "deployments"),
        ("v1", "services"),
        ("policy/v1", "poddisruptionbudgets"),
        ("v1", "configmaps"),
    ):
        kopf.on.event(group_version, plural, registry=registry)(feed(controller.observe_child))
    return registry


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf builds a diff base (a deep copy of the object) on every event, for change handlers.
    The operator registers event handlers only, which never read it: about 15% of its CPU at
    scale went there."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        """Nothing to remember."""


def build_settings(workers: int) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.peering.standalone = True  # one active instance is ensured by the Lease instead
    settings.posting.enabled = False  # the controller posts its own, meaningful Events
    settings.scanning.disabled = True  # no CRD/namespace watching, so no RBAC for it
    settings.watching.inactivity_timeout = 70.0
    settings.watching.connect_timeout = 10.0
    settings.networking.request_timeout = 30.0
    settings.queueing.worker_limit = max(workers * 8, 64)
    # Children and pods are filtered on the server: the operator never sees foreign objects.
    for selector in (
        ("v1", "pods"),
        ("apps/v1", "deployments"),
        ("v1", "services"),
        ("policy/v1", "poddisruptionbudgets"),
        ("v1", "configmaps"),
    ):
        settings.watching.label_selectors[selector] = MANAGED_SELECTOR
    return settings
