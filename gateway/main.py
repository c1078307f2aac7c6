"""``ladle gateway``: the route table kept fresh from Kubernetes (or a static file), the filter
chain built from the settings, and uvicorn (httptools, uvloop) serving the raw ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import prometheus_client
import uvicorn

from ladle import logs
from ladle.api import API_VERSION, ISVC_PLURAL, LABEL_ISVC
from ladle.audit import AuditLog
from ladle.gateway.apikeys import KeyFileError, KeyStore
from ladle.gateway.app import GatewayApp, Lifecycle
from ladle.gateway.cache import ResponseCache
from ladle.gateway.chain import Chain, Filter
from ladle.gateway.cluster import Cluster, Hooks
from ladle.gateway.filters.authn import Authentication
from ladle.gateway.filters.body import Body
from ladle.gateway.filters.cache import Cache
from ladle.gateway.filters.priority import Priority
from ladle.gateway.filters.ratelimit import RateLimit
from ladle.gateway.filters.route import Route
from ladle.gateway.filters.router import Router
from ladle.gateway.metrics import GatewayMetrics
from ladle.gateway.routes import Pod, Service, build_table, parse_pod, parse_routable
from ladle.gateway.scrape import Scraper
from ladle.gateway.settings import GatewaySettings, SettingsError
from ladle.gateway.static import StaticConfigError, load_static
from ladle.gateway.upstream import Pool
from ladle.gateway.watch import Informer
from ladle.kube import KubeClient, LoginError, login
from ladle.listen import bind

if TYPE_CHECKING:
    from ladle.tracing import Tracing

log = logging.getLogger("ladle.gateway")

TICK_SECONDS = 1.0


class Gateway:
    """The process: route-table sources, router, background tasks."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        self.pool = Pool(connect_timeout=settings.connect_timeout)
        self.scraper = (
            Scraper(self.pool, settings.scrape_interval, own=self._outstanding)
            if settings.scrape_interval
            else None
        )
        scraper = self.scraper
        self.cluster = Cluster(
            self.metrics,
            self.pool,
            max_held=settings.max_held_requests,
            bands=settings.priority_bands,
            default_band=settings.priority_bands.index(settings.default_priority),
            loads=(lambda: scraper.loads) if scraper is not None else dict,
        )
        self.metrics.slot_times(
            lambda: (
                (*state.key, state.slot_seconds)
                for state in self.cluster.states.values()
                if state.slot_timed
            )
        )
        self.audit = AuditLog(settings.audit_log, "gateway", text=settings.audit_text)
        self.tracing: Tracing | None = None
        if settings.otlp_traces_endpoint is not None:
            from ladle.tracing import start_tracing

            self.tracing = start_tracing(
                "ladle-gateway", settings.otlp_traces_endpoint, settings.trace_sample_ratio
            )
            self.metrics.registry.register(
                self.tracing.dropped_metric("ladle_gateway_trace_spans_dropped")
            )
        self.keys: KeyStore | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._service_informers: list[Informer[Service]] = []
        self._pod_informers: list[Informer[Pod]] = []
        self._static: tuple[list[Service], list[Pod]] | None = None
        self._rebuild_scheduled = False
        self.api: KubeClient | None = None
        if settings.static is not None:
            try:
                self._static = load_static(settings.static)
            except StaticConfigError as exc:
                raise SettingsError(str(exc)) from None
        else:
            try:
                login()  # where the watches will connect: a kubeconfig mistake, said now
            except LoginError as exc:
                raise SettingsError(f"{exc}; or route to plain servers with --static") from None
        if settings.api_keys_file is not None:
            try:
                self.keys = KeyStore(settings.api_keys_file, 0.0, settings.priority_bands)
            except KeyFileError as exc:
                raise SettingsError(str(exc)) from None

    def app(self) -> GatewayApp:
        authentication = None if self.keys is None else Authentication(self.keys)
        return GatewayApp(
            self.data_path(authentication),
            self.cluster,
            self.metrics,
            Lifecycle(self.not_ready, self.startup, self.shutdown),
            authentication=authentication,
            access_log=self.settings.access_log,
            audit=self.audit,
            tracing=self.tracing,
        )

    def data_path(self, authentication: Authentication | None) -> Chain:
        """The filter chain, in Envoy's order, with only the filters the settings need."""
        settings = self.settings
        filters: list[Filter] = []
        if authentication is not None:
            filters += [authentication, RateLimit(self.metrics)]
        filters += [
            Priority(settings.priority_bands, settings.default_priority),
            Body(settings.max_request_size),
            Route(self.cluster),
        ]
        if settings.response_cache:
            filters.append(Cache(ResponseCache(settings.response_cache_size), self.metrics))
        router = Router(
            self.cluster,
            self.pool,
            self.metrics,
            count_usage=settings.audit_log is not None,
            tracing=self.tracing,
        )
        return Chain(filters, router)

    def not_ready(self) -> str | None:
        informers: list[Informer[Any]] = [*self._service_informers, *self._pod_informers]
        for informer in informers:
            if not informer.synced.is_set():
                return f"syncing {informer.name}"
        return None

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        if self._static is not None:
            services, pods = self._static
            self.cluster.update(build_table(services, pods), loop.time())
        else:
            self._start_watching()
        self._spawn(self._ticker())
        if self.scraper is not None:
            self._spawn(self.scraper.run(self._pods, lambda: self.cluster.pump_all(loop.time())))
        # What is loaded by now lives as long as the process; frozen, it is skipped by every
        # full collection the data path's garbage triggers (bench/gateway.py: 4% more
        # requests a second).
        gc.freeze()
        log.info(
            "gateway started",
            extra={"url": f"http://{self.settings.host}:{self.settings.port}/v1"},
        )

    def _start_watching(self) -> None:
        from ladle.gateway.status import FIELD_MANAGER, StatusWriter

        api = self.api = KubeClient(FIELD_MANAGER)
        if self.settings.write_status:
            writer = StatusWriter(api, self.settings.identity)
            self.cluster.hooks = Hooks(
                writer.on_transition, writer.on_hold, writer.on_new, writer.on_table
            )
            self._spawn(writer.run())
        scopes = [f"/namespaces/{ns}" for ns in self.settings.namespaces] or [""]
        for scope in scopes:
            self._service_informers.append(
                Informer(
                    api,
                    f"/apis/{API_VERSION}{scope}/{ISVC_PLURAL}",
                    parse_routable,
                    self._changed,
                    name=f"inferenceservices{scope}",
                )
            )
            self._pod_informers.append(
                Informer(
                    api,
                    f"/api/v1{scope}/pods",
                    parse_pod,
                    self._changed,
                    params={"labelSelector": LABEL_ISVC},
                    name=f"pods{scope}",
                )
            )
        informers: list[Informer[Any]] = [*self._service_informers, *self._pod_informers]
        for informer in informers:
            self._spawn(informer.run())

    def _changed(self) -> None:
        """Coalesce a burst of watch events (a re-list, a rollout) into one table rebuild."""
        if not self._rebuild_scheduled:
            self._rebuild_scheduled = True
            asyncio.get_running_loop().call_soon(self._rebuild)

    def _rebuild(self) -> None:
        self._rebuild_scheduled = False
        services = [s for i in self._service_informers for s in i.items.values()]
        pods = [p for i in self._pod_informers for p in i.items.values()]
        self.cluster.update(build_table(services, pods), asyncio.get_running_loop().time())

    def _outstanding(self, pod: str) -> int:
        return self.cluster.in_flight(pod)

    def _pods(self) -> list[Pod]:
        return [
            p
            for variants in self.cluster.table.pods.values()
            for ps in variants.values()
            for p in ps
        ]

    async def _ticker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TICK_SECONDS)
            self.cluster.tick(loop.time())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_crashed)
        self._tasks.append(task)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pool.close()
        self.audit.close()
        if self.tracing is not None:
            self.tracing.close()
        if self.api is not None:
            await self.api.close()


def _crashed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task died", exc_info=task.exception())


def serve(settings: GatewaySettings) -> int:
    logs.configure(settings.log_level)
    prometheus_client.disable_created_metrics()
    gateway = Gateway(settings)  # a SettingsError is one line, printed by the command
    sock = bind(settings.host, settings.port)
    config = uvicorn.Config(
        gateway.app(),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_config=None,
        access_log=False,
        server_header=False,
        proxy_headers=False,
        backlog=4096,
        timeout_graceful_shutdown=int(settings.drain_timeout),
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0
