"""This gateway's requests in flight on each pod, by level: a pod's slots taken by this
replica, and whom a more urgent request may displace there."""

from __future__ import annotations


class InFlight:
    def __init__(self, levels: int) -> None:
        self.levels = levels
        self._total: dict[str, int] = {}
        self._by_level: dict[str, list[int]] = {}

    def __call__(self, pod: str) -> int:
        return self._total.get(pod, 0)

    def sent(self, pod: str, level: int) -> None:
        self._total[pod] = self._total.get(pod, 0) + 1
        counts = self._by_level.get(pod)
        if counts is None:
            counts = self._by_level[pod] = [0] * self.levels
        counts[level] += 1

    def done(self, pod: str, level: int) -> None:
        left = self._total[pod] - 1
        if left:
            self._total[pod] = left
            self._by_level[pod][level] -= 1
        else:
            del self._total[pod]
            del self._by_level[pod]

    def below(self, pod: str, level: int) -> int:
        """Requests on ``pod`` of a lower level (a larger number) than ``level``."""
        counts = self._by_level.get(pod)
        return sum(counts[level + 1 :]) if counts else 0
