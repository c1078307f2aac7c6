"""A pod whose gap between tokens is ``a + k * batch``, as its histogram's totals show it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PacedPod:
    a: float
    k: float
    running: float = 0.0
    total: float = 0.0
    count: float = 0.0

    def step(self, running: float, seconds: float) -> tuple[float, float]:
        """``ladle:inter_token_latency_seconds``'s (sum, count) after ``seconds`` in which the
        batch went from the last count to ``running``: its mean over them sets the gap."""
        batch = (self.running + running) / 2
        self.total += batch * seconds
        self.count += batch * seconds / (self.a + self.k * batch)
        self.running = running
        return self.total, self.count
