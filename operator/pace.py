"""How a replica's decode pace slows with its batch, learned from the pods' own metrics.

The target is set in concurrency, but concurrency is not the traffic. By Little's law a pod
running ``b`` requests serves ``b / S(b)`` of them a second, where ``S(b)``, the time one takes,
grows with the batch. A pod at twice the target is not two replicas' worth of traffic (its
requests are slow because it is crowded, and they will be quicker on more replicas), and one at
half the target is more than half. Measured at the target's pace, a pod's running count is worth
``b * S(T) / S(b)`` requests. The two agree at the target, so the fleet still settles where the
target says; away from it, the scaled count is what the traffic needs, not how crowded the pods
happen to be.

``S`` is taken proportional to the gap between tokens, ``g(b) = a + k * b`` (decode is most of a
request's time), fitted by exponentially-weighted least squares to each pod's mean gap between
two scrapes (the change in ``ladle:inter_token_latency_seconds``'s sum over its count) against
its batch meanwhile. Until the pods have been seen at a spread of batches there is no fit, and
running counts are taken as they are.

Pods of one ReplicaSet (one pod template) share a line, and no others do (``Paces``): during a
canary the stable and canary pods run different weights or quantizations, whose paces differ,
and one line through both would fit neither.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# Older samples count half as much every ten minutes: a model's pace does not drift, but a
# rollout can change it.
HALF_LIFE_SECONDS = 600.0
# A fit needs this many (pod, scrape) samples' worth of weight, ...
MIN_SAMPLES = 8.0
# ... and batches spread by this fraction of the target (their standard deviation).
MIN_SPREAD = 0.25


class PodPace(Protocol):
    """What one pod's scrape tells: its batch and its inter-token histogram's running totals."""

    @property
    def name(self) -> str: ...
    @property
    def replica_set(self) -> str: ...
    @property
    def running(self) -> float: ...
    @property
    def itl_sum(self) -> float | None: ...
    @property
    def itl_count(self) -> float | None: ...


@dataclass(frozen=True)
class Pace:
    """The weighted sums of (batch, gap) samples, and each pod's totals at its last scrape."""

    weight: float = 0.0
    batch: float = 0.0
    gap: float = 0.0
    batch2: float = 0.0
    batch_gap: float = 0.0
    time: float | None = None
    # (pod, running, histogram sum, histogram count)
    last: tuple[tuple[str, float, float, float], ...] = ()
    # (a, k) of ``g(b) = a + k * b``, or None.
    line: tuple[float, float] | None = None

    def observe(self, now: float, pods: Iterable[PodPace], target: float) -> Pace:
        """Fold in one tick's scrapes, and fit the line again if the samples can tell.

        A pod seen for the first time, restarted (its totals went back) or idle since its last
        scrape adds no sample. The samples cannot tell while they are too few, or their batches
        too alike for the target's scale; then the last line holds: a steady load keeps the
        batches near the target, where the line matters least, and fades the spread that
        found it. A line that says nothing physical (a gap that does not grow with the batch,
        or none at a batch of zero) is no line."""
        before = {name: (running, s, c) for name, running, s, c in self.last}
        decay = 1.0 if self.time is None else 0.5 ** ((now - self.time) / HALF_LIFE_SECONDS)
        w, b, g, bb, bg = (
            x * decay for x in (self.weight, self.batch, self.gap, self.batch2, self.batch_gap)
        )
        last = []
        for pod in pods:
            total, count = pod.itl_sum, pod.itl_count
            if total is None or count is None or not _counted(total) or not _counted(count):
                continue
            last.append((pod.name, pod.running, total, count))
            if pod.name not in before:
                continue
            running, total_before, count_before = before[pod.name]
            tokens, seconds = count - count_before, total - total_before
            if tokens <= 0 or seconds < 0:
                continue
            batch, gap = (running + pod.running) / 2, seconds / tokens
            w, b, g, bb, bg = w + 1, b + batch, g + gap, bb + batch * batch, bg + batch * gap
        line = self.line
        if w >= MIN_SAMPLES:
            mean_b, mean_g = b / w, g / w
            var = bb / w - mean_b * mean_b
            if var >= (MIN_SPREAD * target) ** 2:
                k = (bg / w - mean_b * mean_g) / var
                a = mean_g - k * mean_b
                line = (a, k) if k > 0 and a > 0 else None
        return Pace(w, b, g, bb, bg, now, tuple(last), line)


@dataclass(frozen=True)
class Paces:
    """One ``Pace`` per ReplicaSet, by name."""

    by_replica_set: tuple[tuple[str, Pace], ...] = ()

    def observe(
        self, now: float, pods: Iterable[PodPace], target: float, valid: Iterable[PodPace]
    ) -> Paces:
        """Fold in one tick: ``pods`` are all the pods scraped, ``valid`` those whose numbers
        can teach. A ReplicaSet with no pod left is forgotten once another has pods (a
        rollout replaced it, or its canary ended); with no pod anywhere (scaled to zero, or
        every pod restarting) every line is kept for the pods' return."""
        present = {p.replica_set for p in pods}
        teaching = list(valid)
        known = dict(self.by_replica_set)
        names = sorted(present) if present else sorted(known)
        return Paces(
            tuple(
                (
                    name,
                    known.get(name, Pace()).observe(
                        now, [p for p in teaching if p.replica_set == name], target
                    ),
                )
                for name in names
            )
        )

    def lines(self) -> dict[str, tuple[float, float]]:
        """The ReplicaSets whose pace is known, and its line."""
        return {name: pace.line for name, pace in self.by_replica_set if pace.line is not None}


def _counted(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def at_target(running: float, target: float, line: tuple[float, float]) -> float:
    """A pod's running count as requests at the target's pace: ``b * g(T) / g(b)``, written
    as ``g(T) / (a / b + k)``, whose every rounding keeps the order of counts (the product
    form could rank a count a hair above another one ulp below it)."""
    a, k = line
    if running <= 0:
        return 0.0
    return (a + k * target) / (a / running + k)
