"""The GPUPool reconciler: who may use a pool, how many replicas each member gets, pool status.

Grants come from ``quota.plan_pool`` over the members' claims and what their pods hold; this
module gathers those inputs from the store, keeps each pool's plan until an input changes, and
queues the members whose grant moved. It also keeps a pool that is still in use from being
deleted under its services (the ``ladle.dev/in-use`` finalizer), and reports overlaps between
pools.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ladle.api import (
    API_VERSION,
    POOL_FINALIZER,
    POOL_KIND,
    GPUPool,
    GPUPoolSpec,
    InferenceService,
    rfc3339,
)
from ladle.kube import KubeClient
from ladle.operator.conditions import POOL_CONDITIONS, POOL_STATUS_FIELDS
from ladle.operator.config import OperatorConfig
from ladle.operator.events import ObjectRef
from ladle.operator.pool_status import PoolFacts, derive_pool_status
from ladle.operator.quota import Claim, PoolPlan, plan_pool
from ladle.operator.status import Problem
from ladle.operator.status_writer import StatusWriter
from ladle.operator.store import NodeInfo, PodInfo, Store, node_matches
from ladle.operator.telemetry import Metrics
from ladle.words import plural

log = logging.getLogger("ladle.operator.pools")

IsvcKey = tuple[str, str]
ISVC = "InferenceService"
POOL_STATUS_INTERVAL = 1.0  # seconds


def pool_ref(pool: GPUPool) -> ObjectRef:
    return ObjectRef(API_VERSION, POOL_KIND, "", pool.meta.name, pool.meta.uid)


@dataclass(frozen=True)
class Grant:
    """What an InferenceService may run, as its pool decided."""

    replicas: int
    # It may run one spare replica during a rollout.
    surge: bool
    pool: GPUPoolSpec | None
    gpu_resource: str
    # Why fewer replicas than requested, in words.
    note: str | None = None
    # Why it cannot run in its pool at all (a missing pool, a namespace the pool refuses).
    blocker: Problem | None = None


class PoolReconciler:
    def __init__(
        self,
        store: Store,
        client: KubeClient,
        writer: StatusWriter,
        config: OperatorConfig,
        queue_isvc: Callable[[IsvcKey], None],
        queue_pool: Callable[[str, float], None],
        metrics: Metrics,
    ) -> None:
        self.metrics = metrics
        self.store = store
        self.client = client
        self.writer = writer
        self.config = config
        self.queue_isvc = queue_isvc
        self.queue_pool = queue_pool
        # Each quota pool's plan, dropped when any input changes: every reconcile of a member
        # reads it, and recomputing it each time would cost O(members) per reconcile.
        self._plans: dict[str, PoolPlan[IsvcKey]] = {}
        # The grants of each pool's last plan: the "current" replicas of the next.
        self._granted: dict[str, dict[IsvcKey, int]] = {}
        # Members whose rollout is due, and (pools without a quota) those allowed to surge.
        self._rolling: dict[str, set[IsvcKey]] = {}
        # Canary replicas each member asks for on top of its own (during a canary rollout).
        self._canary: dict[str, dict[IsvcKey, int]] = {}
        self._surging: dict[str, set[IsvcKey]] = {}
        self._written_at: dict[str, float] = {}

    # ---- inputs

    def invalidate(self, pool: str) -> None:
        """An input of the pool's plan changed: replan on next use, and refresh its status."""
        self._plans.pop(pool, None)
        self.queue_pool(pool, 0)

    def members(self, pool: str) -> list[InferenceService]:
        return [i for i in self.store.by_index(ISVC, "pool", pool) if not i.meta.deleting]

    def allowed(self, pool: GPUPool, namespace: str) -> bool:
        selector = pool.spec.namespace_selector
        if selector is None:
            return True
        labels = self.store.get("Namespace", ("", namespace))
        return selector.matches(labels or {})

    def forget(self, key: IsvcKey) -> None:
        """An InferenceService is gone: its GPUs may go to others once its pods are gone."""
        pools = set()
        for table in (self._rolling, self._surging):
            for pool, members in table.items():
                if key in members:
                    members.discard(key)
                    pools.add(pool)
        for counts in (self._granted, self._canary):
            for pool, by_key in counts.items():
                if by_key.pop(key, None) is not None:
                    pools.add(pool)
        for pool in pools:
            self.invalidate(pool)

    def _held(self, pool: GPUPool) -> dict[IsvcKey, int]:
        """GPUs the pool's runtime pods hold, by the InferenceService they belong to."""
        held: dict[IsvcKey, int] = {}
        resource = pool.spec.resource_name
        pod: PodInfo
        for pod in self.store.by_index("Pod", "pool", pool.meta.name):
            gpus = pod.gpus(resource)
            if gpus:
                owner = (pod.namespace, pod.owner)
                held[owner] = held.get(owner, 0) + gpus
        return held

    def _nodes(self, pool: GPUPool) -> list[NodeInfo]:
        return [n for n in self.store.values("Node") if node_matches(pool.spec, n)]

    def _free_gpus(self, pool: GPUPool, held: int) -> int:
        resource = pool.spec.resource_name
        allocatable = sum(
            n.gpus(resource, allocatable=True)
            for n in self._nodes(pool)
            if n.ready and not n.unschedulable
        )
        return allocatable - held

    def _current(self, pool: str, isvc: InferenceService) -> int:
        granted = self._granted.get(pool, {}).get(isvc.key)
        if granted is not None:
            return granted
        return sum(
            int((d.get("spec") or {}).get("replicas") or 0)
            for d in self.store.by_index("Deployment", "owner", isvc.key)
        )

    # ---- the plan

    def plan(self, pool: GPUPool, reconciling: IsvcKey | None = None) -> PoolPlan[IsvcKey]:
        """The pool's plan; members whose grant moved are queued (but ``reconciling``)."""
        name = pool.meta.name
        cached = self._plans.get(name)
        if cached is not None:
            return cached
        held = self._held(pool)
        rolling = self._rolling.get(name, set())
        claims = [
            Claim(
                key=isvc.key,
                created=isvc.meta.created,
                requested_replicas=self._asked(name, isvc),
                gpus_per_replica=isvc.spec.gpus_per_replica,
                current_replicas=self._current(name, isvc),
                min_replicas=isvc.spec.min_replicas,
                held_gpus=held.pop(isvc.key, 0),
                wants_surge=isvc.key in rolling,
            )
            for isvc in self.members(name)
            if self.allowed(pool, isvc.meta.namespace)
        ]
        orphans = sum(held.values())  # pods of services that are gone or refused
        total = orphans + sum(c.held_gpus for c in claims)
        plan = plan_pool(
            pool.spec.quota_gpus,
            claims,
            orphan_gpus=orphans,
            free_gpus=self._free_gpus(pool, total),
        )
        before = self._granted.get(name, {})
        for key, granted in plan.granted.items():
            if before.get(key) != granted and key != reconciling:
                self.queue_isvc(key)
        self._granted[name] = dict(plan.granted)
        self._plans[name] = plan
        return plan

    def _asked(self, pool: str, isvc: InferenceService) -> int:
        return isvc.requested_replicas + self._canary.get(pool, {}).get(isvc.key, 0)

    def grant(self, isvc: InferenceService, rolling: bool, canary: int = 0) -> Grant:
        """The replicas (and surge) of one member, canary replicas included; ``rolling``: its
        rollout is due; ``canary``: the canary replicas it asks for besides its own."""
        requested = isvc.requested_replicas + canary
        name = isvc.spec.gpu_pool
        if not name:
            return Grant(requested, True, None, self.config.default_gpu_resource)
        pool: GPUPool | None = self.store.get("GPUPool", ("", name))
        if pool is None:
            blocker = Problem("GPUPoolNotFound", f'GPUPool "{name}" does not exist', True)
            return Grant(0, True, None, self.config.default_gpu_resource, blocker=blocker)
        resource = pool.spec.resource_name
        if not self.allowed(pool, isvc.meta.namespace):
            blocker = Problem(
                "NamespaceNotAllowed",
                f"namespace {isvc.meta.namespace} may not use GPUPool {name}: its labels do "
                f"not match the pool's namespaceSelector ({pool.spec.namespace_selector})",
                True,
            )
            return Grant(0, True, pool.spec, resource, blocker=blocker)
        self._set_rolling(name, isvc.key, rolling)
        self._set_canary(name, isvc.key, canary)
        if pool.spec.quota_gpus is None:
            surge = self._surge_without_quota(pool, isvc, rolling)
            return Grant(requested, surge, pool.spec, resource)
        plan = self.plan(pool, reconciling=isvc.key)
        granted = plan.granted.get(isvc.key, 0)
        note = None
        if granted < requested:
            gpus = isvc.spec.gpus_per_replica
            # A split model's replica needs every one of its GPUs at once.
            each = f" of {gpus} GPUs each" if gpus > 1 else ""
            note = (
                f"GPUPool {name} quota of {plural(plan.quota_gpus or 0, 'GPU')} allows "
                f"{granted} of {plural(requested, 'replica')}{each} "
                f"({plural(plan.claimed_gpus, 'GPU')} claimed, "
                f"{plan.requested_gpus} requested)"
            )
        return Grant(granted, not rolling or isvc.key in plan.surge, pool.spec, resource, note)

    def _set_canary(self, pool: str, key: IsvcKey, canary: int) -> None:
        counts = self._canary.setdefault(pool, {})
        if counts.get(key, 0) != canary:
            if canary:
                counts[key] = canary
            else:
                counts.pop(key, None)
            self._plans.pop(pool, None)

    def _set_rolling(self, pool: str, key: IsvcKey, rolling: bool) -> None:
        members = self._rolling.setdefault(pool, set())
        if (key in members) != rolling:
            if rolling:
                members.add(key)
            else:
                members.discard(key)
                self._surging.get(pool, set()).discard(key)
            self._plans.pop(pool, None)

    def _surge_without_quota(self, pool: GPUPool, isvc: InferenceService, rolling: bool) -> bool:
        """Without a quota, surge while the pool's nodes have a spare replica's GPUs."""
        surging = self._surging.setdefault(pool.meta.name, set())
        if not rolling or isvc.key in surging:
            return True
        gpus = isvc.spec.gpus_per_replica
        reserved = sum(
            i.spec.gpus_per_replica for i in self.members(pool.meta.name) if i.key in surging
        )
        held = sum(self._held(pool).values())
        if self._free_gpus(pool, held) - reserved < gpus:
            return False
        surging.add(isvc.key)
        return True

    # ---- the pool itself

    async def reconcile(self, name: str) -> None:
        pool: GPUPool | None = self.store.get("GPUPool", ("", name))
        if pool is None:
            for table in (self._plans, self._granted, self._rolling, self._surging, self._canary):
                table.pop(name, None)
            self._written_at.pop(name, None)
            self.metrics.forget_pool(name)
            return
        members = self.members(name)
        plan = self.plan(pool) if pool.spec.quota_gpus is not None else self._plain_plan(pool)
        await self._protect(pool, in_use=bool(members) or plan.held_gpus > 0)
        facts = PoolFacts(
            services=len(members),
            overlaps=self._overlaps(pool),
            blocking_deletion=tuple(f"{i.meta.namespace}/{i.meta.name}" for i in members)
            if pool.meta.deleting
            else (),
        )
        previous = self.writer.previous(
            pool.meta.uid, pool.status, POOL_STATUS_FIELDS, POOL_CONDITIONS
        )
        status = derive_pool_status(
            pool, list(self.store.values("Node")), plan, facts, rfc3339(), previous
        )
        self.metrics.observe_pool(name, status, pool.spec.quota_gpus)
        if status == previous:
            return
        # A pool's counts move with every member: write them at most once a second.
        wait = self._written_at.get(name, -POOL_STATUS_INTERVAL) + POOL_STATUS_INTERVAL
        if time.monotonic() < wait:
            self.queue_pool(name, wait - time.monotonic())
            return
        await self.writer.write(pool_ref(pool), status, previous)
        self._written_at[name] = time.monotonic()

    def _plain_plan(self, pool: GPUPool) -> PoolPlan[IsvcKey]:
        """A pool without a quota grants what is asked; the plan only counts, for status."""
        held = self._held(pool)
        claims = [
            Claim(
                isvc.key,
                isvc.meta.created,
                self._asked(pool.meta.name, isvc),
                isvc.spec.gpus_per_replica,
                held_gpus=held.pop(isvc.key, 0),
            )
            for isvc in self.members(pool.meta.name)
            if self.allowed(pool, isvc.meta.namespace)
        ]
        return plan_pool(None, claims, orphan_gpus=sum(held.values()))

    def _overlaps(self, pool: GPUPool) -> dict[str, int]:
        mine = {n.name for n in self._nodes(pool)}
        overlaps = {}
        other: GPUPool
        for other in self.store.values("GPUPool"):
            if other.meta.name == pool.meta.name or other.meta.deleting:
                continue
            if other.spec.resource_name != pool.spec.resource_name:
                continue
            shared = len(mine & {n.name for n in self._nodes(other)})
            if shared:
                overlaps[other.meta.name] = shared
        return overlaps

    async def _protect(self, pool: GPUPool, in_use: bool) -> None:
        """Hold the pool's finalizer while InferenceServices (or their pods) use it."""
        has = POOL_FINALIZER in pool.meta.finalizers
        if has == in_use or (in_use and pool.meta.deleting):
            return  # (no finalizer may be added to an object being deleted)
        metadata: dict[str, object] = {"name": pool.meta.name}
        if in_use:
            metadata["finalizers"] = [POOL_FINALIZER]
        # Server-side apply: leaving the finalizer out removes the one this manager set.
        await self.client.apply(
            {"apiVersion": API_VERSION, "kind": POOL_KIND, "metadata": metadata}, force=True
        )
        log.info(
            "GPUPool in use" if in_use else "GPUPool no longer in use",
            extra={"object": pool.meta.name, "kind": POOL_KIND, "finalizer": POOL_FINALIZER},
        )
