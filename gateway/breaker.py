"""A per-service circuit breaker: closed → open → half-open, in Resilience4j's shape.

It trips on the failure rate over a time-based sliding window once the window holds a minimum
number of calls, or when a service that should have pods has had none ready for a hold time.
After ``open_seconds`` it lets a few probe requests through (half-open); their failure rate
decides between closing and opening again. It never half-opens while no pod is ready, since a
probe could only wait. Pure: every method takes ``now`` (monotonic seconds).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from ladle.api import BreakerConfig
from ladle.words import plural


class State(enum.StrEnum):
    CLOSED = "Closed"
    OPEN = "Open"
    HALF_OPEN = "HalfOpen"


class Admission(enum.Enum):
    PASS = "pass"  # closed: an ordinary call
    PROBE = "probe"  # half-open: one of the permitted trial calls
    REJECT = "reject"  # open, or half-open with every probe slot taken


@dataclass(frozen=True)
class Transition:
    old: State
    new: State
    reason: str


class CircuitBreaker:
    def __init__(self, config: BreakerConfig, now: float) -> None:
        self.config = config
        self.state = State.CLOSED
        self.since = now
        self.reason = "no failures"
        # One bucket per whole second of the window: [second, calls, failures].
        self._buckets: deque[list[int]] = deque()
        self._calls = 0
        self._failures = 0
        self._probes_sent = 0
        self._probe_results: list[bool] = []
        self._no_ready_since: float | None = None
        self._ready = 1

    # -- calls ---------------------------------------------------------------------------

    def allow(self, now: float) -> Admission:
        """Whether a call may go to the service now; a PROBE must be reported as a probe."""
        if not self.config.enabled:
            return Admission.PASS
        self.tick(now)
        if self.state is State.CLOSED:
            return Admission.PASS
        if self.state is State.HALF_OPEN and self._probes_sent < self.config.half_open_probes:
            self._probes_sent += 1
            return Admission.PROBE
        return Admission.REJECT

    def record(self, now: float, success: bool, *, probe: bool = False) -> Transition | None:
        """The outcome of an admitted call (a probe's outcome only counts while half-open)."""
        if not self.config.enabled:
            return None
        if probe:
            return self._record_probe(now, success) if self.state is State.HALF_OPEN else None
        if self.state is not State.CLOSED:
            return None  # a call admitted before the breaker opened
        self._add(int(now), success)
        cfg = self.config
        if self._calls >= cfg.minimum_calls and self._failures >= cfg.failure_rate * self._calls:
            rate = self._failures / self._calls
            return self._to(
                State.OPEN,
                now,
                f"failure rate {rate:.0%} over the last {plural(self._calls, 'call')} "
                f"(threshold {cfg.failure_rate:.0%})",
            )
        return None

    def release_probe(self) -> None:
        """A probe slot handed out but never used (the request ended before reaching a pod)."""
        if self.state is State.HALF_OPEN and self._probes_sent > len(self._probe_results):
            self._probes_sent -= 1

    # -- time and readiness ---------------------------------------------------------------

    def observe_ready(self, now: float, ready: int, expected: bool) -> Transition | None:
        """Ready pods right now, and whether the service should have any (not scaled to zero)."""
        self._ready = ready
        if ready > 0 or not expected:
            self._no_ready_since = None
        elif self._no_ready_since is None:
            self._no_ready_since = now
        return self.tick(now)

    def tick(self, now: float) -> Transition | None:
        """Time-driven transitions; the gateway calls this every second and on each call."""
        if not self.config.enabled:
            return None
        cfg = self.config
        if (
            self.state is not State.OPEN
            and self._no_ready_since is not None
            and now - self._no_ready_since >= cfg.no_ready_seconds
        ):
            return self._to(
                State.OPEN, now, f"no ready pods for {now - self._no_ready_since:.0f} s"
            )
        if self.state is State.OPEN and now - self.since >= cfg.open_seconds and self._ready > 0:
            return self._to(State.HALF_OPEN, now, f"open for {cfg.open_seconds:g} s; probing")
        return None

    # -- internals ------------------------------------------------------------------------

    def _record_probe(self, now: float, success: bool) -> Transition | None:
        self._probe_results.append(success)
        failed = self._probe_results.count(False)
        permitted = self.config.half_open_probes
        if failed >= self.config.failure_rate * permitted:
            return self._to(State.OPEN, now, f"{failed} of {permitted} probes failed")
        if len(self._probe_results) >= permitted:
            return self._to(
                State.CLOSED, now, f"{permitted - failed} of {permitted} probes succeeded"
            )
        return None

    def _add(self, second: int, success: bool) -> None:
        horizon = second - self.config.window_seconds
        while self._buckets and self._buckets[0][0] <= horizon:
            _, calls, failures = self._buckets.popleft()
            self._calls -= calls
            self._failures -= failures
        if not self._buckets or self._buckets[-1][0] != second:
            self._buckets.append([second, 0, 0])
        bucket = self._buckets[-1]
        bucket[1] += 1
        self._calls += 1
        if not success:
            bucket[2] += 1
            self._failures += 1

    def _to(self, state: State, now: float, reason: str) -> Transition:
        old = self.state
        self.state = state
        self.since = now
        self.reason = reason
        self._probes_sent = 0
        self._probe_results = []
        if state is State.CLOSED:
            self._buckets.clear()
            self._calls = self._failures = 0
        return Transition(old, state, reason)
