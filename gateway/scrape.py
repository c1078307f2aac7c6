"""Reads each ready pod's own load every few seconds: ``ladle:num_requests_running``,
``ladle:num_requests_waiting`` and ``ladle:kv_cache_usage_perc`` from its /metrics. The picker
uses them to break ties and to steer around saturated pods, and the cluster counts the slots
that others' requests hold (another gateway replica's, or clients' that call the pod directly).
A failed scrape forgets the pod's numbers instead of keeping stale ones (unknown load is not
zero load, and not full load either).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ladle.gateway.routes import Pod
from ladle.gateway.upstream import Pool, UpstreamError
from ladle.runtime_metrics import KV_USAGE, RUNNING, WAITING, samples

log = logging.getLogger("ladle.gateway")


@dataclass(frozen=True)
class PodLoad:
    waiting: float
    kv_usage: float
    running: float = 0.0
    # Requests the pod had that were not this gateway's (running and waiting, less what this
    # gateway had in flight to it when the page was read).
    others: float = 0.0


def parse_load(text: bytes) -> PodLoad | None:
    """The three gauges from a pod's page (requests summed over label sets, the fullest cache);
    None when their lines do not parse, the page lacks one, or says nonsense (NaN,
    negative)."""
    try:
        found = samples(text.decode("utf-8", "replace"), (RUNNING, WAITING, KV_USAGE))
    except ValueError:
        return None
    values = [v for got in found.values() for _, v in got]
    if not all(found.values()) or any(math.isnan(v) or v < 0 for v in values):
        return None
    return PodLoad(
        waiting=sum(v for _, v in found[WAITING]),
        kv_usage=max(v for _, v in found[KV_USAGE]),
        running=sum(v for _, v in found[RUNNING]),
    )


class Scraper:
    def __init__(
        self,
        pool: Pool,
        interval: float,
        timeout: float = 1.0,
        own: Callable[[str], int] = lambda pod: 0,
    ) -> None:
        self.pool = pool
        self.interval = interval
        self.timeout = timeout
        self.own = own  # this gateway's requests in flight to a pod, by its id
        self.loads: dict[str, PodLoad] = {}

    async def run(
        self, pods: Callable[[], Iterable[Pod]], scraped: Callable[[], None] = lambda: None
    ) -> None:
        while True:
            targets = [p for p in pods() if p.ready]
            results = await asyncio.gather(*(self._scrape(p) for p in targets))
            self.loads = {p.id: load for p, load in zip(targets, results, strict=True) if load}
            scraped()
            await asyncio.sleep(self.interval)

    async def _scrape(self, pod: Pod) -> PodLoad | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            response = await self.pool.request(
                pod.host, pod.port, b"GET", b"/metrics", [(b"accept", b"text/plain")], b"", deadline
            )
            body = await response.read_all(deadline)
        except UpstreamError as exc:
            log.debug("scrape failed", extra={"pod": pod.id, "error": str(exc)})
            return None
        load = parse_load(body) if response.status == 200 else None
        if load is None:
            return None
        others = max(0.0, load.running + load.waiting - self.own(pod.id))
        return dataclasses.replace(load, others=others)
