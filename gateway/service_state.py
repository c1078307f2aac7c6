"""The live routing state of one InferenceService: its breaker, outlier detector, ready pods
and hash rings, the flow queue where its requests wait, and who competes for its slots."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ladle.gateway.breaker import CircuitBreaker
from ladle.gateway.flow import FlowQueue
from ladle.gateway.outlier import OutlierDetector
from ladle.gateway.picker import HashRing
from ladle.gateway.routes import Pod, Service, ServiceKey


@dataclass(eq=False, slots=True)
class Waiter:
    """A request waiting in the flow queue, with what binding it to a pod needs."""

    level: int
    variant: str | None  # chosen by the split on arrival; None while there is no ready pod
    tried: set[str]
    sticky: bytes | None
    prefix: bytes | None
    future: asyncio.Future[Pod | None]
    placed: Pod | None = None


class ServiceState:
    def __init__(self, service: Service, now: float, bands: int, capacity: int) -> None:
        self.service = service
        self.queue: FlowQueue[Waiter] = FlowQueue(bands, capacity)
        # The mean time a request holds a slot; a guess until the first one is timed.
        self.slot_seconds = 1.0
        self.slot_timed = False
        self.breaker = CircuitBreaker(service.breaker, now)
        self.outlier = OutlierDetector(service.outlier)
        self.ready: dict[str, list[Pod]] = {}
        self.rings: dict[str, HashRing] = {}
        self.pod_count = 0
        self.held_since: float | None = None
        # Requests of each (band, tenant) in the gateway, waiting or in flight: who competes
        # for the band's slots now.
        self.present: dict[tuple[int, str], int] = {}

    @property
    def key(self) -> ServiceKey:
        return self.service.key

    def configure(self, service: Service, now: float) -> None:
        old = self.service
        self.service = service
        if service.breaker != old.breaker:
            self.breaker = CircuitBreaker(service.breaker, now)
        if service.outlier != old.outlier:
            self.outlier = OutlierDetector(service.outlier)

    def set_pods(self, ready: dict[str, list[Pod]], all_pods: set[str]) -> None:
        self.ready = ready
        self.pod_count = sum(len(p) for p in ready.values())
        for variant, pods in ready.items():
            names = [p.id for p in pods]
            ring = self.rings.get(variant)
            if ring is None or ring.pods != frozenset(names):
                self.rings[variant] = HashRing(names)
        for variant in self.rings.keys() - ready.keys():
            del self.rings[variant]
        self.outlier.retain(all_pods)

    # -- levels: a band, split by fair shares ---------------------------------------------

    def arrive(self, band: int, tenant: str) -> int:
        """Count a request in, and return its level: ``2 * band``, plus one unless its tenant
        is under its fair share of the service's slots (the slots over the tenants its band
        has in the gateway, waiting or in flight, with at least one other besides it). A
        request under its share may displace one over its share in the same band, as a higher
        band may displace a lower one: so a light tenant beside a heavy one waits for a step,
        not for one of the heavy one's requests to finish. Alone, a tenant is never under its
        share, so that its requests are not all raised above the next tenant to come."""
        level = 2 * band + 1
        if not tenant:
            return level
        present = self.present
        mine = present.get((band, tenant), 0)
        present[(band, tenant)] = mine + 1
        if self.service.priority_scheduling:
            tenants = sum(1 for b, _ in present if b == band)
            slots = self.service.concurrency * self.pod_count
            if tenants > 1 and mine * tenants < slots:
                level -= 1
        return level

    def depart(self, band: int, tenant: str) -> None:
        if not tenant:
            return
        key = (band, tenant)
        left = self.present[key] - 1
        if left:
            self.present[key] = left
        else:
            del self.present[key]
