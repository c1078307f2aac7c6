"""Flow control: which waiting request gets the next free slot of a pod, and which is shed
when the queue is full.

Three levels, as the Gateway API Inference Extension's flow control has them:

- **Priority bands.** A higher band is always served first; when the queue is full, the
  lowest band present is shed first, and a request of that band or lower is refused.
- **Fair shares within a band**, by a virtual token counter (VTC, Sheng et al., OSDI '24, as
  AIBrix's ``vtc-basic``): each tenant's counter grows by the tokens it is served, and the
  backlogged tenant with the lowest counter goes next. A tenant that comes back from idle is
  lifted to the lowest counter of those waiting, so idle time banks no credit; a heavy tenant
  cannot starve a light one.
- **Earliest deadline first within a tenant.**

Pure: entries carry an opaque payload and the caller says which of them can be placed now.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
# Tenants' counters that a band keeps for tenants with nothing queued, before it forgets those
# that would be lifted anyway.
_KEPT_COUNTERS = 1024


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    band: int  # 0 is the highest
    tenant: str
    deadline: float
    cost: float  # the tokens charged to the tenant when the entry is served
    payload: T
    seq: int = 0

    def order(self) -> tuple[float, int]:
        return (self.deadline, self.seq)


@dataclass(slots=True)
class _Band(Generic[T]):
    # Each backlogged tenant's entries, a heap by (deadline, arrival).
    queues: dict[str, list[tuple[float, int, Entry[T]]]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    length: int = 0

    def floor(self) -> float:
        """The lowest counter among backlogged tenants (what a returning tenant is lifted to)."""
        return min((self.counters.get(t, 0.0) for t in self.queues), default=0.0)

    def heads(self) -> list[Entry[T]]:
        """Each backlogged tenant's next entry, the next to serve first."""
        heads = [q[0][2] for q in self.queues.values()]
        heads.sort(key=lambda e: (self.counters.get(e.tenant, 0.0), *e.order()))
        return heads


class FlowQueue(Generic[T]):
    def __init__(self, bands: int, capacity: int) -> None:
        self._bands: list[_Band[T]] = [_Band() for _ in range(bands)]
        self.capacity = capacity
        self.length = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self.length

    def band_length(self, band: int) -> int:
        return self._bands[band].length

    def push(self, entry: Entry[T]) -> Entry[T] | None:
        """Queue ``entry``; returns what was shed to make room (``entry`` itself when nothing
        of a lower band was there to shed), or None."""
        shed: Entry[T] | None = None
        if self.length >= self.capacity:
            shed = self._victim()
            if shed is None or shed.band <= entry.band:
                return entry
            self.remove(shed)
        band = self._bands[entry.band]
        entry.seq = next(self._seq)
        queue = band.queues.get(entry.tenant)
        if queue is None:
            floor = band.floor() if band.queues else None
            queue = band.queues[entry.tenant] = []
            if floor is not None and band.counters.get(entry.tenant, 0.0) < floor:
                band.counters[entry.tenant] = floor
            if len(band.counters) > _KEPT_COUNTERS:
                self._forget_idle(band)
        heapq.heappush(queue, (entry.deadline, entry.seq, entry))
        band.length += 1
        self.length += 1
        return shed

    def pop(self, fits: Callable[[Entry[T]], bool] = lambda e: True) -> Entry[T] | None:
        """The next entry to serve among those ``fits`` accepts, charged to its tenant.

        Only each tenant's head is offered (earliest deadline first within a tenant); one that
        does not fit now (a retry whose untried pods are all busy) lets the next go."""
        for band in self._bands:
            if not band.length:
                continue
            for head in band.heads():
                if fits(head):
                    self.remove(head)
                    self.charge(head.band, head.tenant, head.cost)
                    return head
        return None

    def remove(self, entry: Entry[T]) -> bool:
        """Take ``entry`` out (its client left, or its deadline passed); False if not queued."""
        band = self._bands[entry.band]
        queue = band.queues.get(entry.tenant)
        item = (entry.deadline, entry.seq, entry)
        if queue is None or item not in queue:
            return False
        if queue[0][2] is entry:
            heapq.heappop(queue)
        else:
            queue.remove(item)
            heapq.heapify(queue)
        if not queue:
            del band.queues[entry.tenant]
        band.length -= 1
        self.length -= 1
        return True

    def charge(self, band: int, tenant: str, tokens: float) -> None:
        """Tokens served to a tenant (a correction once the answer's real count is known may
        be negative)."""
        counters = self._bands[band].counters
        counters[tenant] = counters.get(tenant, 0.0) + tokens

    def entries(self) -> Iterator[Entry[T]]:
        for band in self._bands:
            for queue in band.queues.values():
                for _, _, entry in queue:
                    yield entry

    def _victim(self) -> Entry[T] | None:
        """What a full queue sheds: in the lowest band present, the latest deadline of the
        tenant that has been served the most."""
        for band in reversed(self._bands):
            if band.length:
                tenant = max(band.queues, key=lambda t: (band.counters.get(t, 0.0), t))
                return max((e for _, _, e in band.queues[tenant]), key=Entry.order)
        return None

    @staticmethod
    def _forget_idle(band: _Band[T]) -> None:
        """Drop the counters of idle tenants at or below the floor (they would be lifted to it
        on their return anyway), then the oldest idle ones while too many are kept: a client
        that invents a tenant per request costs memory only up to the bound."""
        floor = band.floor()
        idle = [t for t in band.counters if t not in band.queues]
        for tenant in idle:
            if band.counters[tenant] <= floor or len(band.counters) > _KEPT_COUNTERS:
                del band.counters[tenant]
