"""``ladle operator``: leader election around the reconcile workers, fed by one kopf operator.

Every leadership term starts from a new controller with an empty store, primed by listing the
cluster, so losing the Lease (an apiserver outage longer than the renew deadline, say) returns
the process to standby cleanly instead of killing it, and it competes for the Lease again.

kopf starts with the first term and then runs for the life of the process, its events routed to
whichever controller leads (and dropped while none does). Stopping kopf at the end of a term
is not safe: after a freeze or an outage, aiohttp can turn kopf's cancellation into a timeout
that kopf retries, and its watchers then never stop (seen after an API server restart).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import kopf

from ladle import logs
from ladle.kube import REQUEST_ERRORS, KubeClient, login
from ladle.operator.config import OperatorConfig
from ladle.operator.controller import Controller
from ladle.operator.leader import (
    ElectionTiming,
    LeaderElector,
    LeadershipLost,
    LeaseNamespaceMissing,
)
from ladle.operator.telemetry import Health, Metrics, build_app, serve
from ladle.operator.watch import REQUIRED, Watched, build_registry, build_settings, served

log = logging.getLogger("ladle.operator")

State = Literal["starting", "standby", "priming", "leading", "stopping"]
# How long kopf may take to finish its watches when the process stops.
KOPF_EXIT_SECONDS = 10.0


@dataclass(frozen=True)
class Options:
    config: OperatorConfig = field(default_factory=OperatorConfig)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 8080
    leader_elect: bool = True
    lease_namespace: str = "ladle-system"
    lease_name: str = "ladle-operator"
    identity: str = "ladle-operator"
    timing: ElectionTiming = field(default_factory=ElectionTiming)
    workers: int = 32
    resync_seconds: float = 600.0
    log_level: str = "info"


class Router:
    """Where kopf's events go: the leading term's controller, or nowhere."""

    def __init__(self) -> None:
        self.controller: Controller | None = None

    def observe(self, kind: str, event_type: str | None, obj: Mapping[str, Any]) -> None:
        if self.controller is not None:
            self.controller.observe(kind, event_type, obj)


class Operator:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.metrics = Metrics()
        self.state: State = "starting"
        self.stop = asyncio.Event()
        self.router = Router()
        self.kopf_stop = asyncio.Event()
        self.kopf_task: asyncio.Task[None] | None = None
        self.failed = False
        # The kinds kopf watches, found before the first term primes (kopf starts once).
        self.watched: frozenset[Watched] | None = None

    def ready(self) -> bool:
        # A standby is ready too: it is healthy, and a rolling update must be able to proceed.
        return self.state in ("standby", "leading")

    def _observe_request(self, method: str, seconds: float) -> None:
        self.metrics.api_latency.labels(method).observe(seconds)

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)

    async def run(self) -> int:
        opts = self.options
        self._install_signals()
        runner = await serve(
            build_app(self.metrics, Health(self.ready)), opts.metrics_host, opts.metrics_port
        )
        observe = self._observe_request
        # The Lease has a client of its own: its requests never queue behind the reconcilers'
        # connections, and none outlives one renewal attempt.
        lease_client = (
            KubeClient(
                opts.config.field_manager,
                timeout_seconds=opts.timing.attempt_seconds,
                observe=observe,
            )
            if opts.leader_elect
            else None
        )
        elector = (
            LeaderElector(
                lease_client, opts.lease_namespace, opts.lease_name, opts.identity, opts.timing
            )
            if lease_client is not None
            else None
        )
        # Every write stops at the end of the leader's term (see leader.py).
        client = KubeClient(
            opts.config.field_manager,
            observe=observe,
            fence=elector.fence if elector is not None else None,
        )
        code = 0
        try:
            while not self.stop.is_set():
                if elector is not None:
                    self.state = "standby"
                    if not await self._until_stopped(elector.acquire()):
                        break
                try:
                    await self._lead(client, elector)
                except LeadershipLost:
                    log.warning("stepped down; competing for the lease again")
        except LeaseNamespaceMissing as missing:
            log.error(
                f"the Lease namespace {missing} does not exist: create it, or pass "
                "--lease-namespace (LADLE_OPERATOR_LEASE_NAMESPACE)"
            )
            code = 2
        finally:
            self.state = "stopping"
            self.metrics.leader.set(0)
            if elector is not None:
                await elector.release()
            await self._stop_kopf()
            await client.close()
            if lease_client is not None:
                await lease_client.close()
            await runner.cleanup()
        log.info("operator stopped")
        return 1 if self.failed and code == 0 else code

    async def _start_kopf(self) -> None:
        """Start kopf once; take SIGTERM/SIGINT back from it, since it stops only when told."""
        if self.kopf_task is not None:
            return
        started = asyncio.Event()
        self.kopf_task = asyncio.create_task(
            kopf.operator(
                registry=build_registry(self.router.observe, login, self.watched or REQUIRED),
                settings=build_settings(self.options.workers),
                clusterwide=True,
                standalone=True,
                # Our own identity: kopf would otherwise derive one from $POD_ID or the
                # process's user name, which uid 10001 lacks in the image (getpwuid fails).
                # kopf types it as a NewType of str that it does not export.
                identity=self.options.identity,  # type: ignore[arg-type]
                stop_flag=self.kopf_stop,
                ready_flag=started,
            ),
            name="kopf",
        )
        self.kopf_task.add_done_callback(self._kopf_ended)
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait({waiter, self.kopf_task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        self._install_signals()

    def _kopf_ended(self, task: asyncio.Task[None]) -> None:
        if not self.kopf_stop.is_set():
            log.error("kopf stopped by itself; shutting down")
            self.failed = True
            self.stop.set()

    async def _stop_kopf(self) -> None:
        if self.kopf_task is None:
            return
        self.kopf_stop.set()
        done, _ = await asyncio.wait({self.kopf_task}, timeout=KOPF_EXIT_SECONDS)
        if not done:
            log.warning("kopf did not stop in time; exiting without it")

    async def _until_stopped(self, coro: Coroutine[Any, Any, object]) -> bool:
        """Run ``coro`` unless a stop arrives first; True if it finished."""
        task = asyncio.create_task(coro)
        stopper = asyncio.create_task(self.stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for pending in (task, stopper):
            if pending not in done:
                pending.cancel()
        await asyncio.gather(task, stopper, return_exceptions=True)
        if task in done:
            task.result()
            return True
        return False

    async def _prime(self, controller: Controller, client: KubeClient) -> bool:
        delay = 1.0
        while not self.stop.is_set():
            try:
                if self.watched is None:
                    self.watched = await served(client)
                await controller.prime(self.watched)
                return True
            except REQUEST_ERRORS as err:
                log.warning("could not list the cluster; retrying", extra={"error": str(err)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0)
        return False

    async def _lead(self, client: KubeClient, elector: LeaderElector | None) -> None:
        opts = self.options
        self.state = "priming"
        controller = Controller(
            client,
            opts.config,
            self.metrics,
            identity=opts.identity,
            workers=opts.workers,
            resync_seconds=opts.resync_seconds,
        )
        holder = asyncio.create_task(elector.hold()) if elector is not None else None
        # Events from now on reach the new store; priming lists what came before.
        self.router.controller = controller
        try:
            if not await self._until_stopped(self._prime(controller, client)) or self.stop.is_set():
                return
            await self._start_kopf()
            workers = asyncio.create_task(controller.run(), name="reconcilers")
            stopper = asyncio.create_task(self.stop.wait(), name="stop")
            self.state = "leading"
            self.metrics.leader.set(1)
            log.info("reconciling", extra={"workers": opts.workers, "identity": opts.identity})
            watched = {workers, stopper} | ({holder} if holder else set())
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            self.metrics.leader.set(0)
            for task in (workers, stopper):
                if task not in done:
                    task.cancel()
            await asyncio.gather(workers, stopper, return_exceptions=True)
            if holder is not None and holder in done:
                holder.result()  # raises LeadershipLost
            if workers in done:
                workers.result()
        finally:
            self.router.controller = None
            self.metrics.leader.set(0)
            self.metrics.forget_objects()
            controller.stop()
            if holder is not None and not holder.done():
                holder.cancel()
                await asyncio.gather(holder, return_exceptions=True)


def run(options: Options) -> int:
    logs.configure(options.log_level)
    operator = Operator(options)
    with asyncio.Runner() as runner:
        code = runner.run(operator.run())
        if operator.kopf_task is not None and not operator.kopf_task.done():
            # kopf's watchers would not stop (see the module docstring): closing the loop
            # would wait for them for ever. The Lease is released already.
            logging.shutdown()
            os._exit(code)
    return code
