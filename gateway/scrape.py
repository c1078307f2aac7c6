"""Reads each ready pod's own load every few seconds: ``ladle:num_requests_waiting`` and
``ladle:kv_cache_usage_perc`` from its /metrics, which the picker uses to break ties and to
steer around saturated pods. A failed scrape forgets the pod's numbers instead of keeping
stale ones (unknown load is not zero load, and not full load either).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ladle.gateway.routes import Pod
from ladle.gateway.upstream import Pool, UpstreamError
from ladle.runtime_metrics import KV_USAGE, WAITING, samples

log = logging.getLogger("ladle.gateway")


@dataclass(frozen=True)
class PodLoad:
    waiting: float
    kv_usage: float


def parse_load(text: bytes) -> PodLoad | None:
    """The two gauges from a pod's page (queued requests summed over label sets, the fullest
    cache); None when their lines do not parse, the page lacks one, or says nonsense (NaN,
    negative)."""
    try:
        found = samples(text.decode("utf-8", "replace"), (WAITING, KV_USAGE))
    except ValueError:
        return None
    values = [v for got in found.values() for _, v in got]
    if not all(found.values()) or any(math.isnan(v) or v < 0 for v in values):
        return None
    return PodLoad(sum(v for _, v in found[WAITING]), max(v for _, v in found[KV_USAGE]))


class Scraper:
    def __init__(self, pool: Pool, interval: float, timeout: float = 1.0) -> None:
        self.pool = pool
        self.interval = interval
        self.timeout = timeout
        self.loads: dict[str, PodLoad] = {}

    async def run(self, pods: Callable[[], Iterable[Pod]]) -> None:
        while True:
            targets = [p for p in pods() if p.ready]
            results = await asyncio.gather(*(self._scrape(p) for p in targets))
            self.loads = {p.id: load for p, load in zip(targets, results, strict=True) if load}
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
        return parse_load(body) if response.status == 200 else None
