"""The operator's own /metrics, /healthz and /readyz, and its structured JSON logging."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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

from ladle.operator.rollout import PHASES, RolloutState

log = logging.getLogger("ladle.operator")


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
    await web.TCPSite(runner, host, port).start()
    log.info("serving metrics and health", extra={"address": f"http://{host}:{port}"})
    return runner


def configure_logging(level: str) -> None:
    """JSON lines on stderr for the operator and for kopf alike (kopf's own formatter)."""
    import kopf

    level = level.upper()
    kopf.configure(
        debug=level == "DEBUG", quiet=level in ("WARNING", "ERROR"), log_format=kopf.LogFormat.JSON
    )
    # Per-object handler chatter and "Activity ... succeeded" from kopf are noise; the
    # reconcilers log what matters. Both stay visible at debug.
    if level != "DEBUG":
        for name in ("kopf.objects", "kopf.activities"):
            logging.getLogger(name).setLevel(logging.WARNING)
