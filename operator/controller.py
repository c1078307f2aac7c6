"""The controller: watch events → store → work queue → reconcilers, for one leadership term.

Events only update the store and queue keys, without awaiting anything, so the store changes
atomically. Workers reconcile one key at a time (``inference`` and ``pools``); decisions are pure
functions in ``desired``, ``quota`` and ``status``.

**Watch gaps.** kopf re-lists a kind after its watch fails with 410 Gone (etcd compacted past
the watch's resourceVersion, or a restarted API server), and it reports the listed objects as
events of type None, but says nothing about objects deleted during the gap. Three things keep
the store honest, from fastest to slowest:

1. A new leadership term starts from an empty store and lists everything (``prime``). A
   leader frozen or cut off for longer than the renew deadline always starts a new term.
2. A re-list seen after priming (events of type None) schedules a **sweep**: every watched
   kind is listed again, and what the lists no longer hold is evicted as if deleted, unless a
   watch event about it arrived after the list began (client-go's Reflector does the same on
   re-list, with DeletedFinalStateUnknown).
3. The periodic resync sweeps too, which covers a kind whose re-list came back empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ladle.api import (
    HTTP_ROUTE_KIND,
    INFERENCE_POOL_KIND,
    ISVC_KIND,
    MODEL_REWRITE_KIND,
    POOL_KIND,
    GPUPool,
    InferenceService,
    parse_isvc,
    parse_pool,
)
from ladle.kube import REQUEST_ERRORS, ApiError, Fenced, KubeClient
from ladle.logs import object_id
from ladle.operator.applier import ChildApplier
from ladle.operator.autoscaler import Autoscaler
from ladle.operator.conditions import ISVC_CONDITIONS, ISVC_STATUS_FIELDS
from ladle.operator.config import OperatorConfig
from ladle.operator.events import EventRecorder
from ladle.operator.inference import InferenceServiceReconciler
from ladle.operator.pools import PoolReconciler
from ladle.operator.status_writer import StatusWriter
from ladle.operator.store import (
    NodeInfo,
    ObjKey,
    PodInfo,
    Store,
    child_relevant,
    owner_of,
    trim_child,
)
from ladle.operator.telemetry import Metrics
from ladle.operator.watch import CHILD_KINDS, REQUIRED, WATCHED, Watched
from ladle.operator.workqueue import WorkQueue

log = logging.getLogger("ladle.operator.controller")

# A re-list arrives as a burst of events; sweep once it is over.
SWEEP_DEBOUNCE_SECONDS = 2.0


@dataclass(frozen=True)
class WorkKey:
    kind: Literal["isvc", "pool"]
    namespace: str
    name: str


def _key(obj: Mapping[str, Any]) -> ObjKey:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name")))


def _holding(pod: PodInfo | None) -> object:
    """What of a pod its pool's quota counts."""
    return None if pod is None else (pod.pool, pod.holds, tuple(pod.limits.items()))


def _start_facts(pod: PodInfo | None) -> object:
    """What of a pod its service's status reads, and what a group's leader gives its
    workers."""
    if pod is None:
        return None
    return (pod.problem, pod.starting_since, pod.leads, pod.refused)


def _held_since(isvc: InferenceService) -> bool:
    return bool((isvc.status.get("gateway") or {}).get("heldSince"))


def _fallback_key(isvc: InferenceService) -> list[ObjKey]:
    name = isvc.spec.traffic.fallback
    return [(isvc.meta.namespace, name)] if name else []


def new_store() -> Store:
    store = Store()
    store.add_indexer(ISVC_KIND, "pool", lambda i: [i.spec.gpu_pool] if i.spec.gpu_pool else [])
    store.add_indexer(ISVC_KIND, "fallback", _fallback_key)
    for kind in CHILD_KINDS:
        store.add_indexer(kind, "owner", owner_of)
    store.add_indexer("Pod", "owner", lambda p: [(p.namespace, p.owner)])
    store.add_indexer("Pod", "pool", lambda p: [p.pool] if p.pool else [])
    return store


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
        self.metrics = metrics
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.queue: WorkQueue[WorkKey] = WorkQueue(
            on_wait=lambda urgent, seconds: metrics.queue_wait.labels(
                "urgent" if urgent else "normal"
            ).observe(seconds)
        )
        self.store = new_store()
        self.recorder = EventRecorder(client, metrics, identity)
        self.writer = StatusWriter(client, self.recorder)
        self.applier = ChildApplier(client, self.store, self.recorder, metrics, self.queue.backoff)
        self.pools = PoolReconciler(
            self.store,
            client,
            self.writer,
            config,
            queue_isvc=lambda key: self.queue.add(WorkKey("isvc", *key)),
            queue_pool=lambda name, delay: self.queue.add_after(WorkKey("pool", "", name), delay),
            metrics=metrics,
        )
        self.inference = InferenceServiceReconciler(
            self.store,
            client,
            self.applier,
            self.pools,
            self.writer,
            self.recorder,
            metrics,
            config,
            requeue=self._requeue_isvc,
        )
        self.autoscaler = Autoscaler(
            self.store,
            client,
            self.recorder,
            metrics,
            gateway_namespace=config.gateway_namespace,
            gateway_selector=config.gateway_selector,
        )
        self._primed = False
        # What kopf watches: WATCHED less the optional kinds the API server does not serve.
        self.served = REQUIRED
        self._sweep_due = asyncio.Event()
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._group: asyncio.TaskGroup | None = None

    def _requeue_isvc(self, key: tuple[str, str], delay: float) -> None:
        work = WorkKey("isvc", *key)
        if delay > 0:
            self.queue.add_after(work, delay)
        else:
            self.queue.add(work)

    # ---- observation: called from kopf's event handlers; no awaits, so the store stays coherent

    def observe(self, kind: str, event_type: str | None, obj: Mapping[str, Any]) -> None:
        if event_type is None and self._primed:
            self._schedule_sweep()  # kopf is re-listing: something may have vanished
        key = _key(obj)
        if event_type == "DELETED":
            self._changed(kind, key, self.store.get(kind, key), None)
            return
        new = self._summary(kind, obj)
        if new is not None:
            self._changed(kind, key, self.store.get(kind, key), new)

    def _summary(self, kind: str, obj: Mapping[str, Any]) -> Any:
        try:
            if kind == ISVC_KIND:
                return parse_isvc(obj)
            if kind == POOL_KIND:
                return parse_pool(obj)
            if kind == "Node":
                return NodeInfo.from_node(obj)
            if kind == "Namespace":
                return dict((obj.get("metadata") or {}).get("labels") or {})
            if kind == "Pod":
                return PodInfo.from_pod(obj)
            return trim_child({**obj, "kind": kind})
        except (KeyError, TypeError, ValueError) as err:
            log.error(
                "unreadable object",
                extra={"kind": kind, "object": object_id(*_key(obj)), "error": str(err)},
            )
            return None

    def _changed(self, kind: str, key: ObjKey, old: Any, new: Any) -> None:
        """Record a change in the store and queue whatever it concerns."""
        if new is None:
            if old is None:
                return
            self.store.delete(kind, key)
        else:
            self.store.upsert(kind, key, new)
        if kind == ISVC_KIND:
            self._isvc_changed(key, old, new)
        elif kind == POOL_KIND:
            self._pool_changed(old, new)
        elif kind == "Node":
            if old != new:
                self._all_pools_changed()
        elif kind == "Namespace":
            if old != new:
                self._namespace_changed(key[1])
        elif kind == "Pod":
            self._pod_changed(old, new)
        elif child_relevant(old) != child_relevant(new):
            for owner in owner_of(new or old):
                self.queue.add(WorkKey("isvc", *owner))

    def _isvc_changed(
        self, key: ObjKey, old: InferenceService | None, new: InferenceService | None
    ) -> None:
        spec_changed = (
            old is None
            or new is None
            or (old.meta.generation, old.meta.deleting) != (new.meta.generation, new.meta.deleting)
        )
        # The autoscaler's decision arrives as a status change it wrote (not ours to echo).
        rescaled = (
            old is not None and new is not None and old.requested_replicas != new.requested_replicas
        )
        if spec_changed or rescaled:
            for isvc in (old, new):
                if isvc is not None and isvc.spec.gpu_pool:
                    self.pools.invalidate(isvc.spec.gpu_pool)
        if spec_changed:
            # The services that fall back to this one route to it by what it is.
            for other in self.store.by_index(ISVC_KIND, "fallback", key):
                self.queue.add(WorkKey("isvc", *other.key))
        if new is None:
            assert old is not None
            self.inference.deleted(key, old.meta.uid)
            self.queue.add(WorkKey("isvc", *key))
            return
        if _held_since(new) and not (old and _held_since(old)):
            self.autoscaler.poke()  # a request waits at a service with no ready pod
        if rescaled:
            self.queue.add(WorkKey("isvc", *key), urgent=True)
            return
        if (
            not spec_changed
            and old is not None
            and old.meta.annotations == new.meta.annotations
            and self.writer.is_echo(new.meta.uid, new.status, ISVC_STATUS_FIELDS, ISVC_CONDITIONS)
        ):
            return  # the echo of our own status write (an annotation may be a rollout action)
        self.queue.add(WorkKey("isvc", *key), urgent=spec_changed)

    def _pool_changed(self, old: GPUPool | None, new: GPUPool | None) -> None:
        pool = new or old
        assert pool is not None
        name = pool.meta.name
        self.queue.add(WorkKey("pool", "", name))
        if new is None:
            self.writer.forget(pool.meta.uid)
        if old is None or new is None or old.spec != new.spec:
            # Placement, quota or admission changed: every member's grant may change, and
            # other pools' overlap with this one.
            self.pools.invalidate(name)
            self._all_pools_changed()
            for isvc in self.store.by_index(ISVC_KIND, "pool", name):
                self.queue.add(WorkKey("isvc", *isvc.key), urgent=True)

    def _all_pools_changed(self) -> None:
        for _, name in self.store.keys(POOL_KIND):
            self.pools.invalidate(name)

    def _namespace_changed(self, namespace: str) -> None:
        pool: GPUPool
        for pool in self.store.values(POOL_KIND):
            if pool.spec.namespace_selector is None:
                continue
            self.pools.invalidate(pool.meta.name)
            for isvc in self.store.by_index(ISVC_KIND, "pool", pool.meta.name):
                if isvc.meta.namespace == namespace:
                    self.queue.add(WorkKey("isvc", *isvc.key), urgent=True)

    def _pod_changed(self, old: PodInfo | None, new: PodInfo | None) -> None:
        pod = new or old
        assert pod is not None
        if _holding(old) != _holding(new):
            for p in (old, new):
                if p is not None and p.pool:
                    self.pools.invalidate(p.pool)
        # Readiness reaches status through the Deployment; only a pod's own problem (the
        # scheduler's or the kubelet's reason) is read from pods, and whether it waits to
        # start (the reconcile then looks at its Events once it has waited a few seconds).
        if _start_facts(old) != _start_facts(new):
            self.queue.add(WorkKey("isvc", pod.namespace, pod.owner))

    # ---- listing: priming a new term, and sweeping after re-lists

    async def prime(self, served: frozenset[Watched] = REQUIRED) -> None:
        """Fill the store before the first reconcile, so quota plans see every claim and
        status reads every object it depends on (a new leader must not report a Degraded
        service as recovered, or an existing Service as missing). ``served``: the kinds that
        kopf watches, and so the kinds listed."""
        self.served = served
        gaie = self.inference.gaie
        gaie.inference_pools = any(w.kind == INFERENCE_POOL_KIND for w in served)
        gaie.http_routes = any(w.kind == HTTP_ROUTE_KIND for w in served)
        gaie.model_rewrites = any(w.kind == MODEL_REWRITE_KIND for w in served)
        await self.sweep()
        self._primed = True
        log.info(
            "caches primed",
            extra={
                "inferenceservices": self.store.count(ISVC_KIND),
                "gpupools": self.store.count(POOL_KIND),
                "nodes": self.store.count("Node"),
                "pods": self.store.count("Pod"),
            },
        )

    async def sweep(self) -> None:
        """List every watched kind; feed what is listed and evict what vanished."""
        started = self.store.sequence
        for watched in WATCHED:  # in priming order
            if watched in self.served:
                await self._sweep_kind(watched)
        self.store.forget_touches(started)

    async def _sweep_kind(self, watched: Watched) -> None:
        since = self.store.sequence
        params = {"labelSelector": watched.label_selector} if watched.label_selector else None
        items = await self.client.list(watched.list_path, params)
        listed = []
        for obj in items:
            body = {**obj, "kind": watched.kind, "apiVersion": watched.api_version}
            key = _key(body)
            listed.append(key)
            if self.store.touched(watched.kind, key) <= since:
                self.observe(watched.kind, "ADDED", body)
        evicted = self.store.stale(watched.kind, listed, since)
        for key in evicted:
            self._changed(watched.kind, key, self.store.get(watched.kind, key), None)
        if evicted and self._primed:
            log.info(
                "evicted objects a re-list no longer holds",
                extra={"kind": watched.kind, "objects": ["/".join(k) for k in evicted[:20]]},
            )

    def _schedule_sweep(self) -> None:
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        self._sweep_timer = asyncio.get_running_loop().call_later(
            SWEEP_DEBOUNCE_SECONDS, self._sweep_due.set
        )

    async def _sweeper(self) -> None:
        while True:
            await self._sweep_due.wait()
            self._sweep_due.clear()
            try:
                await self.sweep()
            except REQUEST_ERRORS as err:
                log.warning("re-list sweep failed; will retry", extra={"error": str(err)})
                self._schedule_sweep()

    # ---- running

    async def run(self) -> None:
        """Reconcile until cancelled."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            self.applier.start(self._spawn)
            self.inference.canary.start(self._spawn, lambda key: self._requeue_isvc(key, 0))
            # A quarter of the workers wait for spec changes only.
            reserved = max(1, self.workers // 4)
            for index in range(self.workers):
                group.create_task(
                    self._worker(urgent_only=index < reserved), name=f"reconcile-worker-{index}"
                )
            group.create_task(self._resync(), name="resync")
            group.create_task(self._sweeper(), name="sweeper")
            group.create_task(self.recorder.run(), name="events")
            group.create_task(self.autoscaler.run(), name="autoscaler")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        assert self._group is not None
        return self._group.create_task(coro, name=name)

    def stop(self) -> None:
        if self._sweep_timer is not None:
            self._sweep_timer.cancel()
        self.queue.close()
        self.metrics.rollouts.clear()  # the next leader reports them

    async def _resync(self) -> None:
        # Watches catch drift as it happens; this is the safety net for missed events.
        while True:
            await asyncio.sleep(self.resync_seconds)
            self._sweep_due.set()
            for key in self.store.keys(ISVC_KIND):
                self.queue.add(WorkKey("isvc", *key))
            for _, name in self.store.keys(POOL_KIND):
                self.queue.add(WorkKey("pool", "", name))

    async def _worker(self, urgent_only: bool) -> None:
        while True:
            key = await self.queue.get(urgent_only)
            self.metrics.queue_depth.set(len(self.queue))
            started = time.perf_counter()
            try:
                if key.kind == "isvc":
                    await self.inference.reconcile((key.namespace, key.name))
                else:
                    await self.pools.reconcile(key.name)
            except REQUEST_ERRORS as err:
                delay = self.queue.retry(key)
                self.metrics.errors.labels(key.kind).inc()
                self.metrics.reconciles.labels(key.kind, "error").inc()
                # In a namespace being deleted, nothing can be created until our object goes;
                # a fenced write means this term is ending anyway.
                quiet = isinstance(err, Fenced) or (
                    isinstance(err, ApiError) and "being terminated" in err.message
                )
                log.log(
                    logging.INFO if quiet else logging.WARNING,
                    "reconcile failed; will retry",
                    extra={
                        "object": object_id(key.namespace, key.name),
                        "kind": ISVC_KIND if key.kind == "isvc" else POOL_KIND,
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
                    extra={
                        "object": object_id(key.namespace, key.name),
                        "kind": ISVC_KIND if key.kind == "isvc" else POOL_KIND,
                        "retry_in_seconds": delay,
                    },
                )
            else:
                self.queue.forget(key)
                self.metrics.reconciles.labels(key.kind, "ok").inc()
            finally:
                self.metrics.duration.labels(key.kind).observe(time.perf_counter() - started)
                self.queue.done(key)
