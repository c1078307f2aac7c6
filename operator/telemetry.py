"""The operator's own /metrics, /healthz and /readyz (its logs are ``ladle.logs``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ladle.operator.rollout_state import PHASES, RolloutState
from ladle.settings import SettingError

log = logging.getLogger("ladle.operator")

ISVC_REPLICA_STATES = ("requested", "desired", "ready", "available", "updated")
POOL_GPU_FIELDS = {
    "capacity": "on the nodes the pool selects",
    "allocatable": "on those nodes that are ready and schedulable",
    "requested": "its InferenceServices ask for",
    "claimed": "granted to them within the quota",
    "quota": "the quota (absent when the pool has none)",
}


class Metrics:
    """One registry per process, so tests and the exporter see only the operator's series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.reconciles = Counter(
            "ladle_operator_reconcile",
            "Reconciles run, by object kind and result (ok, error).",
            ["kind", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "ladle_operator_reconcile_errors",
            "Reconciles that failed and were requeued with backoff.",
            ["kind"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "ladle_operator_reconcile_duration_seconds",
            "Wall time of one reconcile.",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.applies = Counter(
            "ladle_operator_applies",
            "Server-side applies sent, by child kind.",
            ["kind"],
            registry=self.registry,
        )
        self.events = Counter(
            "ladle_operator_events",
            "Kubernetes Events emitted, by type and reason.",
            ["type", "reason"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "ladle_operator_workqueue_wait_seconds",
            "Time objects wait in the work queue, by lane (urgent: spec changes).",
            ["lane"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.api_latency = Histogram(
            "ladle_operator_api_request_duration_seconds",
            "Latency of the operator's own API requests (watches excluded), by HTTP method.",
            ["method"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "ladle_operator_workqueue_depth",
            "Objects waiting to be reconciled.",
            registry=self.registry,
        )
        self.leader = Gauge(
            "ladle_operator_leader",
            "1 while this instance holds the leader Lease and reconciles.",
            registry=self.registry,
        )
        # What status says, for alerts and dashboards (kube-state-metrics' style): only the
        # leader derives status, and a replica that steps down forgets all of it.
        self.isvc_condition = Gauge(
            "ladle_operator_inferenceservice_condition",
            "1 for each InferenceService condition's current status and reason.",
            ["namespace", "inferenceservice", "type", "status", "reason"],
            registry=self.registry,
        )
        self.isvc_replicas = Gauge(
            "ladle_operator_inferenceservice_replicas",
            "InferenceService replicas by state: requested (by the spec), desired (granted "
            "within the GPUPool quota), ready, available, updated.",
            ["namespace", "inferenceservice", "state"],
            registry=self.registry,
        )
        self.pool_gpus = {
            field: Gauge(
                f"ladle_operator_gpupool_{field}_gpus",
                f"GPUPool GPUs: {doc}.",
                ["gpupool"],
                registry=self.registry,
            )
            for field, doc in POOL_GPU_FIELDS.items()
        }
        self._conditions: dict[tuple[str, str], set[tuple[str, str, str]]] = {}
        service = ["namespace", "inferenceservice"]

        def autoscaler_gauge(name: str, help_: str) -> Gauge:
            return Gauge(
                f"ladle_operator_autoscaler_{name}", help_, service, registry=self.registry
            )

        self.autoscaler_desired = autoscaler_gauge(
            "desired_replicas", "The autoscaler's decision, before the GPUPool's quota."
        )
        self.autoscaler_max = autoscaler_gauge("max_replicas", "The service's maxReplicas.")
        self.autoscaler_ready = autoscaler_gauge(
            "ready_replicas", "Ready pods the autoscaler read metrics from."
        )
        self.autoscaler_panic = autoscaler_gauge(
            "panic", "1 while in panic mode (scaling on the panic window, never down)."
        )
        self.autoscaler_frozen = autoscaler_gauge(
            "metrics_frozen", "1 while some load metrics are unknown and the count holds."
        )
        self.autoscaler_demand = autoscaler_gauge(
            "demand", "Requests wanting a replica, averaged over the stable window."
        )
        labels = ["namespace", "inferenceservice"]
        self.rollbacks = Counter(
            "ladle_operator_rollout_rollbacks",
            "Canary rollouts rolled back or failed, by the gate that ended them (quality, "
            "errorRate, ttftP95, tpotP95, deadline, abort).",
            [*labels, "gate"],
            registry=self.registry,
        )
        self.analyses = Counter(
            "ladle_operator_rollout_analysis",
            "Canary analysis verdicts, by gate and result (pass, fail, inconclusive).",
            [*labels, "gate", "result"],
            registry=self.registry,
        )
        # The state of every InferenceService's rollout, as the leader last wrote it.
        self.rollouts: dict[tuple[str, str], RolloutState] = {}
        self.registry.register(_RolloutCollector(self.rollouts))

    def observe_isvc(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        """Set the gauges from an InferenceService's derived status (every reconcile)."""
        now = {
            (str(c.get("type")), str(c.get("status")), str(c.get("reason") or ""))
            for c in status.get("conditions") or ()
        }
        for gone in self._conditions.get((namespace, name), set()) - now:
            self.isvc_condition.remove(namespace, name, *gone)
        for labels in now:
            self.isvc_condition.labels(namespace, name, *labels).set(1)
        self._conditions[(namespace, name)] = now
        variants = status.get("variants") or ()
        replicas = {
            "requested": sum(int(v.get("requestedReplicas") or 0) for v in variants),
            "desired": sum(int(v.get("desiredReplicas") or 0) for v in variants),
            "ready": int(status.get("readyReplicas") or 0),
            "available": int(status.get("availableReplicas") or 0),
            "updated": int(status.get("updatedReplicas") or 0),
        }
        for state, value in replicas.items():
            self.isvc_replicas.labels(namespace, name, state).set(value)

    def forget_isvc(self, namespace: str, name: str) -> None:
        for labels in self._conditions.pop((namespace, name), set()):
            self.isvc_condition.remove(namespace, name, *labels)
        for state in ISVC_REPLICA_STATES:
            with contextlib.suppress(KeyError):
                self.isvc_replicas.remove(namespace, name, state)

    def observe_pool(self, name: str, status: Mapping[str, Any], quota: int | None) -> None:
        """Set a GPUPool's gauges from its derived status; no quota, no quota series."""
        values = {field: status.get(field) for field in POOL_GPU_FIELDS}
        values["quota"] = quota
        for field, value in values.items():
            if value is None:
                with contextlib.suppress(KeyError):
                    self.pool_gpus[field].remove(name)
            else:
                self.pool_gpus[field].labels(name).set(int(value))

    def forget_pool(self, name: str) -> None:
        for gauge in self.pool_gpus.values():
            with contextlib.suppress(KeyError):
                gauge.remove(name)

    def forget_objects(self) -> None:
        """On stepping down: the new leader reports the objects now."""
        for gauge in (
            self.isvc_condition,
            self.isvc_replicas,
            *self.pool_gpus.values(),
            *self._autoscaler_gauges(),
        ):
            gauge.clear()
        self._conditions.clear()
        self.rollouts.clear()

    def forget_autoscaler(self, namespace: str, name: str) -> None:
        """Drop a service's autoscaler series once it is gone or no longer autoscaled."""
        for gauge in self._autoscaler_gauges():
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)

    def _autoscaler_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.autoscaler_desired,
            self.autoscaler_max,
            self.autoscaler_ready,
            self.autoscaler_panic,
            self.autoscaler_frozen,
            self.autoscaler_demand,
        )


class _RolloutCollector(Collector):
    """Rollout gauges, read from the leader's states at scrape time: a deleted service or the
    end of a leadership term leaves no stale series behind."""

    def __init__(self, states: dict[tuple[str, str], RolloutState]) -> None:
        self.states = states

    def collect(self) -> Iterator[Metric]:
        labels = ["namespace", "inferenceservice"]
        weight = GaugeMetricFamily(
            "ladle_operator_rollout_canary_weight",
            "Percent of traffic the canary takes (0-100).",
            labels=labels,
        )
        step = GaugeMetricFamily(
            "ladle_operator_rollout_step",
            "The rollout step whose weight is in force (0: before any traffic moved).",
            labels=labels,
        )
        phase = GaugeMetricFamily(
            "ladle_operator_rollout_phase",
            "1 for the rollout's current phase.",
            labels=[*labels, "phase"],
        )
        started = GaugeMetricFamily(
            "ladle_operator_rollout_step_started_timestamp_seconds",
            "When the current rollout step started (Unix time).",
            labels=labels,
        )
        for (namespace, name), state in sorted(self.states.items()):
            key = [namespace, name]
            weight.add_metric(key, state.weight if state.active else 0)
            step.add_metric(key, state.step if state.active else 0)
            for value in PHASES:
                phase.add_metric([*key, value], 1.0 if state.phase == value else 0.0)
            if state.active and state.step_started is not None:
                started.add_metric(key, state.step_started)
        yield from (weight, step, phase, started)


@dataclass
class Health:
    """Liveness is the event loop answering; readiness is supplied by the run loop."""

    ready: Callable[[], bool] = lambda: False


def build_app(metrics: Metrics, health: Health) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if health.ready():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="not ready\n")

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application()
    app.add_routes(
        [
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/metrics", metrics_page),
        ]
    )
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as err:
        await runner.cleanup()
        raise SettingError(
            f"--metrics-bind-address {host}:{port}: cannot listen there: {err.strerror}"
        ) from None
    log.info("serving metrics and health", extra={"address": f"http://{host}:{port}"})
    return runner
