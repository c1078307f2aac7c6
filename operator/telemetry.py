"""The operator's own /metrics, /healthz and /readyz (its logs are ``ladle.logs``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
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

from ladle.settings import SettingError

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

    def forget_autoscaler(self, namespace: str, name: str) -> None:
        """Drop a service's autoscaler series once it is gone or no longer autoscaled."""
        for gauge in (
            self.autoscaler_desired,
            self.autoscaler_max,
            self.autoscaler_ready,
            self.autoscaler_panic,
            self.autoscaler_frozen,
            self.autoscaler_demand,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)


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
