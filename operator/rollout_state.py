"""What a canary rollout is, as ``status.rollout`` keeps it: the state a leader carries a
rollout on (``RolloutState``, its gate outcomes and verdicts), the replicas and traffic weights
a state implies, and its JSON form in status. ``rollout.py`` decides the next state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ladle.api import CANARY, JSON, STABLE, parse_rfc3339, rfc3339

Phase = Literal["Idle", "Progressing", "Paused", "Promoted", "RolledBack", "Failed"]
PHASES: tuple[Phase, ...] = ("Progressing", "Paused", "Promoted", "RolledBack", "Failed", "Idle")
Stage = Literal[
    "Scaling", "QualityCheck", "Analysing", "AwaitingPromotion", "Promoting", "Finalizing"
]
Result = Literal["Pass", "Fail", "Inconclusive"]
# Reason of a quality check that is still running when an interval ends.
QUALITY = "quality"


@dataclass(frozen=True)
class GateOutcome:
    """One gate's verdict over one analysis, with the numbers that decided it."""

    gate: str  # quality, errorRate, ttftP95, tpotP95
    result: Result
    message: str


@dataclass(frozen=True)
class QualityVerdict:
    """The quality gate's verdict for one (revision, step), and its numbers for status."""

    revision: str
    step: int
    result: Result
    message: str
    at: float
    numbers: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Analysis:
    """The last analysis verdict: which step, when, and every gate's outcome."""

    step: int
    at: float
    gates: tuple[GateOutcome, ...]

    @property
    def result(self) -> Result:
        return verdict(self.gates)


def verdict(gates: Sequence[GateOutcome]) -> Result:
    results = {g.result for g in gates}
    if "Fail" in results:
        return "Fail"
    if "Inconclusive" in results:
        return "Inconclusive"
    return "Pass"


@dataclass(frozen=True)
class RolloutState:
    """``status.rollout``: everything a leader needs to carry a rollout on."""

    phase: Phase = "Idle"
    stage: Stage | None = None
    message: str = ""
    stable_revision: str | None = None
    stable_template: JSON | None = None
    canary_revision: str | None = None
    canary_template: JSON | None = None
    # The revision that rolled back or failed last: not retried until the spec changes again.
    failed_revision: str | None = None
    # Why the last rollout ended as it did (a gate's reason), and in words.
    reason: str | None = None
    step: int = 0
    weight: int = 0  # the canary's share of traffic, percent
    step_started: float | None = None
    interval_started: float | None = None
    paused_at: float | None = None
    settle_until: float | None = None
    # What Finalizing ends in.
    outcome: Phase = "Idle"
    failures: int = 0
    approved: bool = False
    analysis: Analysis | None = None
    quality: QualityVerdict | None = None

    @property
    def active(self) -> bool:
        return self.canary_revision is not None

    def weights(self) -> list[JSON]:
        """``status.rollout.weights``, which the gateway splits by (absent: all to stable)."""
        if not self.active:
            return []
        return [
            {"variant": STABLE, "weight": 100 - self.weight},
            {"variant": CANARY, "weight": self.weight},
        ]


def canary_replicas(total: int, weight: int) -> int:
    """Canary replicas for a traffic weight: its share of the total, at least one (a canary
    without a pod could not be measured), none when the service is scaled to zero."""
    if total <= 0:
        return 0
    return max(1, math.ceil(total * weight / 100))


def target_weight(state: RolloutState, steps: Sequence[int]) -> int:
    """The weight the canary is sized for: the step in force, the one being entered while
    scaling (``step`` is the step whose weight is in force), or all of it to promote."""
    if state.stage == "Promoting" or state.outcome == "Promoted":
        return 100
    index = state.step if state.stage in ("Scaling", "QualityCheck") else state.step - 1
    return steps[min(max(index, 0), len(steps) - 1)]


def split(state: RolloutState, steps: Sequence[int], total: int) -> tuple[int, int]:
    """(stable, canary) replicas: stable keeps the full count for the whole rollout (it takes
    every request back on a rollback), and the canary follows its weight."""
    if not state.active:
        return total, 0
    return total, canary_replicas(total, target_weight(state, steps))


def _gate_json(g: GateOutcome) -> JSON:
    return {"gate": g.gate, "result": g.result, "message": g.message}


def to_status(state: RolloutState) -> JSON:
    """``status.rollout`` as written (empty fields left out, so that status stays readable)."""
    out: JSON = {"phase": state.phase}
    if state.stage is not None:
        out["stage"] = state.stage
    if state.message:
        out["message"] = state.message
    if state.active:
        out["step"] = state.step
        out["weights"] = state.weights()
    revisions = {
        k: v
        for k, v in (
            ("stable", state.stable_revision),
            ("canary", state.canary_revision),
            ("failed", state.failed_revision),
        )
        if v is not None
    }
    if revisions:
        out["revisions"] = revisions
    if state.stable_template is not None:
        out["stableTemplate"] = state.stable_template
    if state.canary_template is not None:
        out["canaryTemplate"] = state.canary_template
    if state.reason is not None:
        out["reason"] = state.reason
    for key, value in (
        ("stepStartedAt", state.step_started),
        ("intervalStartedAt", state.interval_started),
        ("pausedAt", state.paused_at),
        ("settleUntil", state.settle_until),
    ):
        if value is not None:
            out[key] = rfc3339(value, digits=3)
    if state.stage == "Finalizing":
        out["outcome"] = state.outcome
    if state.failures:
        out["consecutiveFailures"] = state.failures
    if state.approved:
        out["promotionApproved"] = True
    if state.analysis is not None:
        out["lastAnalysis"] = {
            "step": state.analysis.step,
            "time": rfc3339(state.analysis.at, digits=3),
            "result": state.analysis.result,
            "gates": [_gate_json(g) for g in state.analysis.gates],
        }
    if state.quality is not None:
        q = state.quality
        out["quality"] = {
            "revision": q.revision,
            "step": q.step,
            "result": q.result,
            "message": q.message,
            "time": rfc3339(q.at, digits=3),
            # JSON holds no infinity (a canary that answers noise can measure one): the
            # message says it in words.
            **{k: round(v, 6) for k, v in q.numbers.items() if math.isfinite(v)},
        }
    return out


def _phase(value: Any) -> Phase:
    return value if value in PHASES else "Idle"


def from_status(raw: Mapping[str, Any] | None) -> RolloutState:
    """The state a leader carries on from (a missing status.rollout: nothing known yet)."""
    raw = raw or {}
    revisions = raw.get("revisions") or {}
    weights = {str(w.get("variant")): int(w.get("weight", 0)) for w in raw.get("weights") or ()}
    analysis = raw.get("lastAnalysis")
    quality = raw.get("quality")
    stage = raw.get("stage")
    return RolloutState(
        phase=_phase(raw.get("phase")),
        stage=stage
        if stage
        in ("Scaling", "QualityCheck", "Analysing", "AwaitingPromotion", "Promoting", "Finalizing")
        else None,
        message=str(raw.get("message") or ""),
        stable_revision=revisions.get("stable"),
        stable_template=raw.get("stableTemplate"),
        canary_revision=revisions.get("canary"),
        canary_template=raw.get("canaryTemplate"),
        failed_revision=revisions.get("failed"),
        reason=raw.get("reason"),
        step=int(raw.get("step") or 0),
        weight=weights.get(CANARY, 0),
        step_started=parse_rfc3339(raw.get("stepStartedAt")),
        interval_started=parse_rfc3339(raw.get("intervalStartedAt")),
        paused_at=parse_rfc3339(raw.get("pausedAt")),
        settle_until=parse_rfc3339(raw.get("settleUntil")),
        outcome=_phase(raw.get("outcome")),
        failures=int(raw.get("consecutiveFailures") or 0),
        approved=bool(raw.get("promotionApproved")),
        analysis=Analysis(
            step=int(analysis.get("step") or 0),
            at=parse_rfc3339(analysis.get("time")) or 0.0,
            gates=tuple(
                GateOutcome(str(g["gate"]), g["result"], str(g.get("message") or ""))
                for g in analysis.get("gates") or ()
            ),
        )
        if analysis
        else None,
        quality=QualityVerdict(
            revision=str(quality.get("revision")),
            step=int(quality.get("step") or 0),
            result=quality.get("result", "Inconclusive"),
            message=str(quality.get("message") or ""),
            at=parse_rfc3339(quality.get("time")) or 0.0,
            numbers={
                k: float(v)
                for k, v in quality.items()
                if k not in ("revision", "step", "result", "message", "time")
                and isinstance(v, int | float)
            },
        )
        if quality
        else None,
    )
