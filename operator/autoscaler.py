"""The scaling loop in the leader: observe → decide → publish, every tick.

For each InferenceService with ``spec.autoscaling`` it reads the ready pods' and the gateways'
metrics (``scrape``), runs the pure decision (``scaling.decide``), and publishes the decision in
``status.autoscaling`` under its own field manager, with the HPA's ``ScalingActive`` and
``ScalingLimited`` conditions, Events and metrics. It never writes ``spec.replicas`` (that
would fight GitOps): the InferenceService reconciler reads the decision back from status
(``InferenceService.requested_replicas``) and sizes the Deployments, within the GPUPool's
quota. Keeping it in status also lets a new leader start from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from ladle.api import API_VERSION, ISVC_KIND, JSON, InferenceService, rfc3339
from ladle.kube import REQUEST_ERRORS, ApiError, KubeClient, resource_path
from ladle.operator.conditions import SCALING_ACTIVE, SCALING_LIMITED, Condition, merge_conditions
from ladle.operator.events import EventRecorder, ObjectRef
from ladle.operator.load import Observation
from ladle.operator.scaling import (
    METRICS_UNAVAILABLE,
    Decision,
    ScalerState,
    ScalingPolicy,
    decide,
    resumed,
)
from ladle.operator.scrape import Target, gateway_metrics, scrape_gateways, scrape_pods
from ladle.operator.store import PodInfo, Store
from ladle.operator.telemetry import Metrics
from ladle.words import plural

log = logging.getLogger("ladle.operator.autoscaler")

FIELD_MANAGER = "ladle-autoscaler"
TICK_SECONDS = 2.0

IsvcKey = tuple[str, str]


def policy_for(isvc: InferenceService) -> ScalingPolicy:
    spec = isvc.spec
    auto = spec.autoscaling
    assert auto is not None
    return ScalingPolicy(
        min_replicas=spec.min_replicas,
        # The CRD requires maxReplicas with autoscaling; objects from before that rule did not.
        max_replicas=spec.max_replicas or max(spec.min_replicas, spec.replicas),
        target_concurrency=auto.target_concurrency,
        target_kv_usage=auto.target_kv_cache_usage,
        stable_window=auto.stable_window_seconds,
        panic_window_percent=auto.panic_window_percent,
        panic_threshold=auto.panic_threshold_percent / 100.0,
        max_scale_up_rate=auto.max_scale_up_rate,
        max_scale_down_rate=auto.max_scale_down_rate,
        scale_down_delay=auto.scale_down_delay_seconds,
        scale_to_zero_grace=auto.scale_to_zero_grace_period_seconds,
    )


def autoscaling_status(
    isvc: InferenceService,
    decision: Decision,
    previous: Mapping[str, Any],
    last_scale_time: str | None,
    now: str,
) -> JSON:
    """The status this loop owns: its decision, and ScalingActive/ScalingLimited."""
    policy_max = isvc.spec.max_replicas
    if decision.frozen:
        active = Condition(SCALING_ACTIVE, False, METRICS_UNAVAILABLE, decision.message)
    else:
        active = Condition(SCALING_ACTIVE, True, decision.reason, decision.message)
    if policy_max is not None and decision.wanted > policy_max:
        limited = Condition(
            SCALING_LIMITED,
            True,
            "TooManyReplicas",
            f"the load asks for {plural(decision.wanted, 'replica')}; maxReplicas is {policy_max}",
        )
    elif decision.replicas == isvc.spec.min_replicas and decision.wanted < decision.replicas:
        limited = Condition(
            SCALING_LIMITED,
            True,
            "TooFewReplicas",
            f"the load asks for {decision.wanted}; minReplicas is {isvc.spec.min_replicas}",
        )
    else:
        limited = Condition(SCALING_LIMITED, False, "DesiredWithinRange", "within the bounds")
    block: JSON = {
        "desiredReplicas": decision.replicas,
        "reason": decision.reason,
        "message": decision.message,
        "panicking": decision.panicking,
        "metricsFrozen": decision.frozen,
        "paced": decision.paced,
        "demand": f"{decision.stable_demand:.1f}",
    }
    if last_scale_time is not None:
        block["lastScaleTime"] = last_scale_time
    return {
        "autoscaling": block,
        "conditions": merge_conditions(
            previous.get("conditions") or (), [active, limited], isvc.meta.generation, now
        ),
    }


@dataclass
class Tracked:
    """One service's scaler, for as long as this leader runs it."""

    uid: str
    state: ScalerState
    last_scale_time: str | None
    written: JSON | None = None
    frozen: bool = False


def _owned(status: Mapping[str, Any]) -> JSON:
    """The part of a stored status this loop wrote."""
    conditions = [
        c
        for c in status.get("conditions") or ()
        if c.get("type") in (SCALING_ACTIVE, SCALING_LIMITED)
    ]
    return {"autoscaling": status.get("autoscaling") or {}, "conditions": conditions}


class Autoscaler:
    def __init__(
        self,
        store: Store,
        client: KubeClient,
        recorder: EventRecorder,
        metrics: Metrics,
        *,
        gateway_namespace: str | None = None,
        gateway_selector: str | None = None,
        tick_seconds: float = TICK_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.client = client
        self.recorder = recorder
        self.metrics = metrics
        self.gateway_namespace = gateway_namespace
        self.gateway_selector = gateway_selector
        self.tick_seconds = tick_seconds
        self.clock = clock
        self._tracked: dict[IsvcKey, Tracked] = {}
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Decide now instead of at the next tick: a request is being held at zero."""
        self._wake.set()

    async def run(self) -> None:
        """Tick until cancelled."""
        async with aiohttp.ClientSession() as session:
            while True:
                started = self.clock()
                try:
                    await self.tick(session)
                except REQUEST_ERRORS as err:
                    log.warning("autoscaling tick failed", extra={"error": str(err)})
                self._wake.clear()
                remaining = self.tick_seconds - (self.clock() - started)
                if remaining > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), remaining)

    async def tick(self, session: aiohttp.ClientSession) -> None:
        services: list[InferenceService] = [
            isvc
            for isvc in self.store.values(ISVC_KIND)
            if isvc.spec.autoscaling is not None and not isvc.meta.deleting
        ]
        for key in set(self._tracked) - {s.key for s in services}:
            self._forget(key)
        if not services:
            return
        expositions = await self._gateway_expositions(session)
        await asyncio.gather(*(self._scale(session, isvc, expositions) for isvc in services))

    async def _gateway_expositions(
        self, session: aiohttp.ClientSession
    ) -> dict[str, str | BaseException] | None:
        """Every gateway replica's /metrics; None when no gateway is configured."""
        if not (self.gateway_namespace and self.gateway_selector):
            return None
        try:
            pods = await self.client.list(
                resource_path("v1", "Pod", self.gateway_namespace),
                {"labelSelector": self.gateway_selector},
            )
        except REQUEST_ERRORS as err:
            return {"(listing gateway pods)": err}
        targets = [t for t in (_gateway_target(p) for p in pods) if t is not None]
        return await scrape_gateways(session, targets)

    async def _scale(
        self,
        session: aiohttp.ClientSession,
        isvc: InferenceService,
        expositions: Mapping[str, str | BaseException] | None,
    ) -> None:
        policy = policy_for(isvc)
        now = self.clock()
        current = isvc.requested_replicas
        tracked = self._tracked.get(isvc.key)
        if tracked is None or tracked.uid != isvc.meta.uid:
            stored = (isvc.status.get("autoscaling") or {}).get("lastScaleTime")
            tracked = Tracked(isvc.meta.uid, resumed(now, current, policy), stored)
            self._tracked[isvc.key] = tracked
        pods: list[PodInfo] = [
            p for p in self.store.by_index("Pod", "owner", isvc.key) if p.metrics_url
        ]
        targets = [Target(p.name, p.metrics_url) for p in pods if p.metrics_url]
        scraped = zip(pods, await scrape_pods(session, targets), strict=True)
        namespace, name = isvc.key
        starts = [p.start_seconds for p in pods if p.start_seconds is not None]
        obs = Observation(
            time=now,
            current_replicas=current,
            ready_replicas=len(targets),
            pods=[replace(m, replica_set=p.replica_set) for p, m in scraped],
            gateway=None if expositions is None else gateway_metrics(expositions, namespace, name),
            start_seconds=statistics.median(starts) if starts else None,
        )
        decision, tracked.state = decide(policy, tracked.state, obs)
        self._export(isvc, policy, decision, len(targets))
        ref = ObjectRef(API_VERSION, ISVC_KIND, namespace, name, isvc.meta.uid)
        if decision.replicas != current:
            tracked.last_scale_time = rfc3339()
            direction = "up" if decision.replicas > current else "down"
            self.recorder.emit(
                ref,
                "Normal",
                "Scaled",
                f"Scaled {direction} from {current} to {decision.replicas}: {decision.message}",
            )
        if decision.frozen != tracked.frozen:
            tracked.frozen = decision.frozen
            if decision.frozen:
                self.recorder.emit(ref, "Warning", METRICS_UNAVAILABLE, decision.message)
            else:
                self.recorder.emit(ref, "Normal", "MetricsRestored", "load metrics are back")
        await self._publish(isvc, ref, tracked, decision)

    async def _publish(
        self, isvc: InferenceService, ref: ObjectRef, tracked: Tracked, decision: Decision
    ) -> None:
        """Write the decision when it changed (not every tick's new demand figure)."""
        previous = tracked.written or _owned(isvc.status)
        status = autoscaling_status(isvc, decision, previous, tracked.last_scale_time, rfc3339())
        if _gist(status) == _gist(previous):
            return
        body = {
            "apiVersion": API_VERSION,
            "kind": ISVC_KIND,
            "metadata": {"name": ref.name, "namespace": ref.namespace},
            "status": status,
        }
        try:
            await self.client.apply(body, subresource="status", field_manager=FIELD_MANAGER)
        except ApiError as err:
            if err.status == 404:
                return  # deleted meanwhile
            raise
        tracked.written = status

    def _export(
        self, isvc: InferenceService, policy: ScalingPolicy, decision: Decision, ready: int
    ) -> None:
        labels = isvc.key
        m = self.metrics
        m.autoscaler_desired.labels(*labels).set(decision.replicas)
        m.autoscaler_max.labels(*labels).set(policy.max_replicas)
        m.autoscaler_ready.labels(*labels).set(ready)
        m.autoscaler_panic.labels(*labels).set(int(decision.panicking))
        m.autoscaler_frozen.labels(*labels).set(int(decision.frozen))
        m.autoscaler_demand.labels(*labels).set(decision.stable_demand)

    def _forget(self, key: IsvcKey) -> None:
        self._tracked.pop(key, None)
        self.metrics.forget_autoscaler(*key)


def _gist(status: Mapping[str, Any]) -> object:
    """What makes a status worth writing: the decision and the conditions, not the demand
    figures in the numbers and messages, nor the condition times, which move every tick."""
    block = {
        k: v for k, v in (status.get("autoscaling") or {}).items() if k not in ("demand", "message")
    }
    conditions = sorted(
        (c.get("type"), c.get("status"), c.get("reason"), c.get("observedGeneration"))
        for c in status.get("conditions") or ()
    )
    return (sorted(block.items()), conditions)


def _gateway_target(pod: Mapping[str, Any]) -> Target | None:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running":
        return None
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "http":
                host = f"[{ip}]" if ":" in str(ip) else ip
                return Target(
                    str(meta.get("name")), f"http://{host}:{port['containerPort']}/metrics"
                )
    return None
