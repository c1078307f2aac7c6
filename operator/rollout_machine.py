"""One rollout decision's vocabulary: what a reconcile observed, what it decided (the next
state, its Events, what to measure next), and the working state the transitions share."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from ladle.api import JSON, RolloutSpec
from ladle.operator.rollout_state import GateOutcome, QualityVerdict, RolloutState


@dataclass(frozen=True)
class Observation:
    """What one reconcile sees; the I/O layer measures it, this module only decides."""

    now: float
    revision: str
    template: JSON
    rollout: RolloutSpec | None
    # The replicas the service asks for in all (spec or autoscaler): stable runs this many.
    total: int
    # Canary pods of the canary's revision that are available, and how many the pool grants.
    canary_ready: int = 0
    canary_granted: int = 0
    # The canary replicas the pool was asked for (the grant answers that question, not
    # necessarily the one a new step asks).
    canary_asked: int = 0
    # The stable Deployment runs the template it was last given, with ``total`` available.
    stable_complete: bool = False
    action: str | None = None
    # A quality check that finished since the last reconcile.
    quality: QualityVerdict | None = None
    # The SLO verdict of the interval that just ended (None: no interval ended).
    slo: tuple[GateOutcome, ...] | None = None
    # This leader holds no metrics baseline for the interval under way (a failover).
    baseline_missing: bool = False
    # Why the pool grants the canary fewer replicas than it wants, in the pool's words.
    quota_note: str | None = None


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    state: RolloutState
    events: tuple[Event, ...] = ()
    # A quality check is wanted now (start one unless it runs already).
    run_quality: bool = False
    # An analysis interval starts now: take the metrics baseline.
    new_interval: bool = False
    # Reconcile again after this many seconds (None: only on events).
    wake_in: float | None = None
    # (gate, result) of every analysis counted, and the gate of a rollback, for metrics.
    analysed: tuple[tuple[str, str], ...] = ()
    rolled_back: str | None = None
    # The observed action (an annotation) was acted on; otherwise it had nothing to act on.
    action_used: bool = False


class Machine:
    """One decision's working state: the state so far, Events, measurements wanted."""

    def __init__(self, state: RolloutState, obs: Observation) -> None:
        self.state = state
        self.obs = obs
        self.events: list[Event] = []
        self.run_quality = False
        self.new_interval = False
        self.wake: list[float] = []
        self.analysed: list[tuple[str, str]] = []
        self.rolled_back: str | None = None
        self.action_used = False

    def set(self, **changes: Any) -> None:
        self.state = replace(self.state, **changes)

    def emit(self, type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def wake_at(self, when: float) -> None:
        self.wake.append(max(when - self.obs.now, 0.05))

    def decision(self) -> Decision:
        return Decision(
            self.state,
            tuple(self.events),
            self.run_quality,
            self.new_interval,
            min(self.wake) if self.wake else None,
            tuple(self.analysed),
            self.rolled_back,
            self.action_used,
        )
