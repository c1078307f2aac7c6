"""``ladle operator``: leader election around one kopf operator and the reconcile workers.

Every leadership term starts from empty caches and a fresh kopf registry, so losing the Lease
(an apiserver outage longer than the renew deadline, say) returns the process to standby
cleanly instead of killing it, and it competes for the Lease again.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import kopf

from ladle.operator.config import OperatorConfig
from ladle.operator.controller import Controller, build_registry, build_settings
from ladle.operator.kube import REQUEST_ERRORS, KubeClient, login
from ladle.operator.leader import ElectionTiming, LeaderElector, LeadershipLost
from ladle.operator.telemetry import Health, Metrics, build_app, configure_logging, serve

log = logging.getLogger("ladle.operator")

State = Literal["starting", "standby", "priming", "leading", "stopping"]


@dataclass(frozen=True)
class Options:
    config: OperatorConfig = field(default_factory=OperatorConfig)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 8080
    leader_elect: bool = True
    lease_namespace: str = "default"
    lease_name: str = "ladle-operator"
    identity: str = "ladle-operator"
    timing: ElectionTiming = field(default_factory=ElectionTiming)
    workers: int = 32
    resync_seconds: float = 600.0
    log_level: str = "INFO"


class Operator:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.metrics = Metrics()
        self.state: State = "starting"
        self.stop = asyncio.Event()

    def ready(self) -> bool:
        # A standby is ready too: it is healthy, and a rolling update must be able to proceed.
        return self.state in ("standby", "leading")

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
        client = KubeClient(
            opts.config.field_manager,
            observe=lambda method, seconds: self.metrics.api_latency.labels(method).observe(
                seconds
            ),
        )
        elector = (
            LeaderElector(client, opts.lease_namespace, opts.lease_name, opts.identity, opts.timing)
            if opts.leader_elect
            else None
        )
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
        finally:
            self.state = "stopping"
            self.metrics.leader.set(0)
            if elector is not None:
                await elector.release()
            await client.close()
            await runner.cleanup()
        log.info("operator stopped")
        return 0

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

    async def _prime(self, controller: Controller) -> bool:
        delay = 1.0
        while not self.stop.is_set():
            try:
                await controller.prime()
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
        if not await self._until_stopped(self._prime(controller)) or self.stop.is_set():
            if holder is not None:
                holder.cancel()
                await asyncio.gather(holder, return_exceptions=True)
            return
        kopf_stop = asyncio.Event()
        kopf_task = asyncio.create_task(
            kopf.operator(
                registry=build_registry(controller, login),
                settings=build_settings(opts.workers),
                clusterwide=True,
                standalone=True,
                stop_flag=kopf_stop,
            ),
            name="kopf",
        )
        workers = asyncio.create_task(controller.run(), name="reconcilers")
        stopper = asyncio.create_task(self.stop.wait(), name="stop")
        self.state = "leading"
        self.metrics.leader.set(1)
        log.info("reconciling", extra={"workers": opts.workers, "identity": opts.identity})
        watched = {kopf_task, workers, stopper} | ({holder} if holder else set())
        done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)

        self.metrics.leader.set(0)
        self.metrics.forget_objects()
        kopf_stop.set()
        for task in (workers, stopper, holder):
            if task is not None and task not in done:
                task.cancel()
        await asyncio.gather(kopf_task, workers, stopper, return_exceptions=True)
        if holder is not None:
            await asyncio.gather(holder, return_exceptions=True)
        controller.queue.close()
        # kopf takes over SIGTERM/SIGINT while it runs: take them back, and if kopf exited on
        # its own, that was a signal meant for us.
        self._install_signals()
        if kopf_task in done and not self.stop.is_set():
            log.info("kopf stopped; shutting down")
            self.stop.set()
        if holder is not None and holder in done:
            holder.result()  # raises LeadershipLost
        if workers in done:
            workers.result()


def run(options: Options) -> int:
    configure_logging(options.log_level)
    return asyncio.run(Operator(options).run())
