"""Per-pod outlier ejection, with Envoy's consecutive-gateway-error defaults.

A pod that returns ``consecutive_errors`` gateway errors in a row (connect failures, resets,
502/503/504, first-token timeouts) is ejected for ``base_ejection_seconds`` times the number of
times it has been ejected; every ``interval_seconds`` it spends healthy and back in rotation
forgives one ejection. At most ``max_ejection_percent`` of a service's pods are out at once,
but at least one may be when there are two or more (as Envoy does); a service's only pod is
never ejected, since the circuit breaker is what handles a service with nowhere else to go.
Pure: every method takes ``now``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ladle.api import OutlierConfig


@dataclass
class _PodRecord:
    consecutive: int = 0
    times_ejected: int = 0
    ejected_until: float | None = None
    # When the multiplier was last forgiven (or the pod last returned).
    healthy_since: float = 0.0


@dataclass(frozen=True)
class Ejection:
    pod: str
    seconds: float
    times: int


def max_ejected(pods: int, percent: int) -> int:
    """How many of ``pods`` may be ejected at once."""
    if pods < 2:
        return 0
    return min(pods - 1, max(1, pods * percent // 100))


class OutlierDetector:
    def __init__(self, config: OutlierConfig) -> None:
        self.config = config
        self._pods: dict[str, _PodRecord] = {}
        # Asked on every request: kept, and recomputed only when an ejection ends or begins.
        self._ejected: frozenset[str] = frozenset()
        self._next_return = math.inf

    def ejected(self, now: float) -> frozenset[str]:
        """Pods out of rotation now; pods whose time is up return to rotation first."""
        if now < self._next_return:
            return self._ejected
        out = []
        self._next_return = math.inf
        for name, rec in self._pods.items():
            if rec.ejected_until is None:
                continue
            if now >= rec.ejected_until:
                rec.ejected_until = None
                rec.consecutive = 0
                rec.healthy_since = now
            else:
                out.append(name)
                self._next_return = min(self._next_return, rec.ejected_until)
        self._ejected = frozenset(out)
        return self._ejected

    def record(self, pod: str, now: float, error: bool, pods: int) -> Ejection | None:
        """One call's outcome at ``pod``; ``pods`` is how many pods the service has."""
        rec = self._pods.setdefault(pod, _PodRecord(healthy_since=now))
        cfg = self.config
        if not error:
            rec.consecutive = 0
            self._forgive(rec, now)
            return None
        rec.consecutive += 1
        if rec.consecutive < cfg.consecutive_errors or rec.ejected_until is not None:
            return None
        if len(self.ejected(now)) >= max_ejected(pods, cfg.max_ejection_percent):
            return None
        self._forgive(rec, now)
        rec.times_ejected += 1
        seconds = cfg.base_ejection_seconds * rec.times_ejected
        rec.ejected_until = now + seconds
        rec.consecutive = 0
        self._ejected = self._ejected | {pod}
        self._next_return = min(self._next_return, rec.ejected_until)
        return Ejection(pod, seconds, rec.times_ejected)

    def retain(self, pods: set[str]) -> None:
        """Forget pods that no longer exist."""
        for name in self._pods.keys() - pods:
            del self._pods[name]
        self._ejected = self._ejected & pods

    def _forgive(self, rec: _PodRecord, now: float) -> None:
        if rec.ejected_until is not None or rec.times_ejected == 0:
            return
        periods = int((now - rec.healthy_since) // self.config.interval_seconds)
        if periods > 0:
            rec.times_ejected = max(0, rec.times_ejected - periods)
            rec.healthy_since += periods * self.config.interval_seconds
