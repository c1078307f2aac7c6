"""The canary rollout state machine: a pure function from what is persisted in
``status.rollout`` and what was just observed to the next state, its Events and what to measure.

A rollout starts when the spec's revision (``revisions.py``) differs from the stable one and
``spec.rollout`` is set; without it a new revision simply becomes stable. Then, stage by stage:

- **Scaling**: canary replicas follow the weight of the step being entered
  (``canary_replicas``); the weight moves only once they are available. A pool without room
  holds the rollout here, with the pool's reason.
- **QualityCheck** (step 0): the quality gate (online ``ladle eval``, stable pod against
  canary pod) runs before any user traffic moves.
- **Analysing**: each analysis interval ends in a verdict over the SLO gates (and the quality
  gate again at the step set by ``recheckAtWeight``). Pass moves to the next step; Fail counts
  towards ``failureLimit`` consecutive failures, which roll back; Inconclusive (too little
  data) holds the step. A step that cannot pass within ``progressDeadlineSeconds`` fails the
  rollout.
- **AwaitingPromotion** (``manualPromotion``): held until ``ladle.dev/rollout-action=promote``.
- **Promoting**: the canary takes all traffic at full size, the stable Deployment moves to
  the canary's revision (the canary *becomes* stable), and traffic returns to it.
- **Finalizing**: weights are back on stable; after a short settle (so every gateway replica
  has seen them) the canary is removed.

The result is a phase, as the ``ladle_operator_rollout_phase`` metric and Argo CD read it:
Progressing, Paused (``spec.rollout.paused`` or the manual gate), Promoted, RolledBack (a gate
failed, or an abort), Failed (the progress deadline), or Idle. A revision that rolled back or
failed is not tried again until the spec changes or ``ladle.dev/rollout-action=retry``.

Everything here is a function of its inputs: time comes in as ``Observation.now``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ladle.api import JSON, RolloutSpec
from ladle.operator.revisions import adapter_sources, carry_adapters, in_place, revision_of
from ladle.operator.rollout_endings import finish, rollback, start_promotion
from ladle.operator.rollout_machine import Decision, Machine, Observation
from ladle.operator.rollout_state import (
    QUALITY,
    Analysis,
    GateOutcome,
    QualityVerdict,
    RolloutState,
    canary_replicas,
    target_weight,
)

# A quality check that could not run (no ready pod, an unreachable server) is tried again after.
QUALITY_RETRY_SECONDS = 5.0


def quality_at(step: int, spec: RolloutSpec) -> bool:
    """Whether the quality gate runs at this step: before traffic, and at the first step at or
    above ``recheckAtWeight``."""
    if not spec.quality.enabled:
        return False
    if step == 0:
        return True
    recheck = spec.quality.recheck_at_weight
    if recheck <= 0:
        return False
    first = next((i for i, w in enumerate(spec.steps, 1) if w >= recheck), None)
    return first == step


def _percent(steps: Sequence[int]) -> str:
    return ", ".join(f"{w}%" for w in steps)


def decide(state: RolloutState, obs: Observation) -> Decision:
    """The next rollout state, given the last one and what was just observed."""
    m = Machine(state, obs)
    spec = obs.rollout
    if m.state.stable_revision is None or m.state.stable_template is None:
        # A new service (or one from before rollouts): what it runs now is stable.
        m.set(stable_revision=obs.revision, stable_template=obs.template)
        return m.decision()
    if m.state.active and m.state.stage in ("Promoting", "Finalizing"):
        finish(m)
        return m.decision()
    if obs.action == "retry" and m.state.failed_revision is not None and not m.state.active:
        m.emit("Normal", "RolloutRetried", f"Retrying revision {m.state.failed_revision}")
        m.set(failed_revision=None)
        m.action_used = True
    if not m.state.active:
        _idle(m, spec)
    elif obs.revision != m.state.canary_revision:
        _spec_moved(m, spec)
    if not _running(m):
        return m.decision()
    if spec is None:
        # spec.rollout removed mid-rollout: the new revision applies directly.
        rollback(m, "RolloutRemoved", "spec.rollout was removed", "Idle", gate=None)
        m.set(stable_revision=obs.revision, stable_template=obs.template, failed_revision=None)
        return m.decision()
    if obs.action == "abort":
        m.action_used = True
        rollback(m, "Aborted", "aborted by ladle.dev/rollout-action=abort", "RolledBack", "abort")
        return m.decision()
    if obs.action == "promote" and not m.state.approved:
        m.action_used = True
        m.set(approved=True)
        m.emit("Normal", "PromotionApproved", "Promotion approved by ladle.dev/rollout-action")
    if spec.paused:
        _pause(m)
        return m.decision()
    if m.state.paused_at is not None:
        _resume(m)
    _progress(m, spec)
    return m.decision()


def _running(m: Machine) -> bool:
    return m.state.active


def _idle(m: Machine, spec: RolloutSpec | None) -> None:
    """No canary runs: a new revision either applies directly or starts one."""
    state, obs = m.state, m.obs
    if obs.revision == state.stable_revision:
        if state.phase in ("RolledBack", "Failed"):
            # The spec went back to what serves: nothing is degraded any more.
            m.set(phase="Idle", reason=None, failed_revision=None, message="")
        return
    assert state.stable_template is not None
    if in_place(state.stable_template, obs.template):
        _adapters_in_place(m, state.stable_template)
        m.set(stable_revision=obs.revision, stable_template=obs.template)
        if state.phase in ("RolledBack", "Failed"):
            m.set(phase="Idle", reason=None, failed_revision=None, message="")
        return
    if spec is None:
        m.set(
            stable_revision=obs.revision,
            stable_template=obs.template,
            phase="Idle",
            reason=None,
            failed_revision=None,
            message="",
        )
        return
    if obs.revision == state.failed_revision:
        return  # held: the failure stands until the spec changes or a retry
    _start(m, spec)


def _adapters_in_place(m: Machine, old: JSON) -> None:
    """An Event for adapters added or removed (every variant takes them, without a canary)."""
    before, after = adapter_sources(old), adapter_sources(m.obs.template)
    added, removed = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
    parts = [f"added {', '.join(added)}"] if added else []
    parts += [f"removed {', '.join(removed)}"] if removed else []
    if parts:
        m.emit("Normal", "AdaptersUpdated", f"Adapters {'; '.join(parts)}, on every variant")


def _carry_to_stable(m: Machine) -> None:
    """Stable takes the adapters the new spec adds or removes, so that both variants answer
    to the same names while the canary tests what changed."""
    stable = m.state.stable_template
    assert stable is not None
    carried = carry_adapters(stable, m.obs.template)
    if carried != stable:
        m.set(stable_template=carried, stable_revision=revision_of(carried))


def _start(m: Machine, spec: RolloutSpec) -> None:
    obs = m.obs
    _carry_to_stable(m)
    m.set(
        phase="Progressing",
        stage="Scaling",
        canary_revision=obs.revision,
        canary_template=obs.template,
        failed_revision=None,
        reason=None,
        step=0,
        weight=0,
        step_started=obs.now,
        interval_started=None,
        paused_at=None,
        settle_until=None,
        outcome="Idle",
        failures=0,
        approved=False,
        analysis=None,
        message=f"starting canary revision {obs.revision}",
    )
    m.emit(
        "Normal",
        "RolloutStarted",
        f"Canary rollout of revision {obs.revision} beside stable revision "
        f"{m.state.stable_revision}; steps {_percent(spec.steps)}",
    )


def _spec_moved(m: Machine, spec: RolloutSpec | None) -> None:
    """The spec changed mid-rollout: back to stable, or a new canary from the start."""
    obs = m.obs
    if obs.revision == m.state.stable_revision:
        rollback(
            m,
            "RolloutCancelled",
            f"the spec returned to stable revision {obs.revision}",
            "Idle",
            gate=None,
        )
        m.set(failed_revision=None)
        return
    old = m.state.canary_revision
    canary = m.state.canary_template
    if canary is not None and in_place(canary, obs.template):
        _adapters_in_place(m, canary)
        _carry_to_stable(m)
        if m.state.stable_revision == obs.revision:
            # The adapter under test went: what is left, stable serves already.
            rollback(
                m, "RolloutCancelled", "the spec no longer changes what stable serves", "Idle", None
            )
            m.set(failed_revision=None)
        else:
            m.set(canary_revision=obs.revision, canary_template=obs.template)
        return
    if spec is None:
        return  # decide() applies it directly
    m.emit(
        "Normal",
        "RolloutRestarted",
        f"The spec changed to revision {obs.revision} during the rollout of {old}: starting again",
    )
    _start(m, spec)


def _pause(m: Machine) -> None:
    # A check that was running when the pause began may finish during it: its verdict is kept
    # and acted on when the rollout resumes.
    _record_quality(m)
    if m.state.paused_at is None:
        m.set(paused_at=m.obs.now)
        m.emit("Normal", "RolloutPaused", f"Paused at step {m.state.step} ({m.state.weight}%)")
    m.set(
        phase="Paused",
        message=f"paused at step {m.state.step} with {m.state.weight}% to the canary "
        "(spec.rollout.paused)",
    )


def _resume(m: Machine) -> None:
    """Paused time does not count against the progress deadline; an interval under way starts
    again (the traffic it saw while paused is not the step's to judge)."""
    state, now = m.state, m.obs.now
    assert state.paused_at is not None
    shift = now - state.paused_at
    m.set(
        paused_at=None,
        phase="Progressing",
        step_started=None if state.step_started is None else state.step_started + shift,
        message=f"resumed at step {state.step} ({state.weight}% to the canary)",
    )
    if state.stage == "Analysing":
        m.set(interval_started=now)
        m.new_interval = True
        # An interval that ended while paused may have been measured just now: it spans the
        # pause, so its verdict is dropped with it.
        m.obs = replace(m.obs, slo=None)
    m.emit("Normal", "RolloutResumed", f"Resumed at step {state.step} ({state.weight}%)")


def _deadline_passed(m: Machine, spec: RolloutSpec, what: str) -> bool:
    started = m.state.step_started
    if started is None:
        m.set(step_started=m.obs.now)
        return False
    deadline = started + spec.progress_deadline_seconds
    if m.obs.now < deadline:
        m.wake_at(deadline)
        return False
    rollback(
        m,
        "ProgressDeadlineExceeded",
        f"step {m.state.step} made no progress in {spec.progress_deadline_seconds}s: {what}",
        "Failed",
        "deadline",
    )
    return True


def _progress(m: Machine, spec: RolloutSpec) -> None:
    stage = m.state.stage
    if stage == "Scaling":
        _scaling(m, spec)
    elif stage == "QualityCheck":
        _quality_check(m, spec)
    elif stage == "Analysing":
        _analysing(m, spec)
    elif stage == "AwaitingPromotion":
        _awaiting(m)


def _scaling(m: Machine, spec: RolloutSpec) -> None:
    state, obs = m.state, m.obs
    want = canary_replicas(obs.total, target_weight(state, spec.steps))
    entering = state.step + 1
    if obs.total <= 0:
        held = "the service is scaled to zero: there is nothing to compare"
    elif obs.canary_asked < want:
        # The pool has not been asked for this step's replicas yet: it will be at once.
        m.set(message=f"step {entering}/{len(spec.steps)}: scaling the canary to {want}")
        m.wake_at(obs.now)
        return
    elif obs.canary_granted < want:
        held = obs.quota_note or (
            f"the GPUPool has room for {obs.canary_granted} of {want} canary replicas"
        )
    elif obs.canary_ready < want:
        held = f"waiting for canary replicas: {obs.canary_ready}/{want} available"
    else:
        if state.step == 0 and quality_at(0, spec):
            m.set(stage="QualityCheck", message="quality gate: comparing canary with stable")
            _quality_check(m, spec)
        else:
            _enter_step(m, spec, entering)
        return
    message = f"step {entering}/{len(spec.steps)}: {held}"
    if obs.canary_granted < want and message != state.message:
        m.emit("Warning", "RolloutHeld", held)
    m.set(message=message, phase="Progressing")
    _deadline_passed(m, spec, held)


def _enter_step(m: Machine, spec: RolloutSpec, step: int) -> None:
    weight = spec.steps[step - 1]
    m.set(
        stage="Analysing",
        step=step,
        weight=weight,
        interval_started=m.obs.now,
        # Each step has its own deadline: scaling and the quality check had theirs.
        step_started=m.obs.now,
        phase="Progressing",
        message=f"step {step}/{len(spec.steps)}: {weight}% to the canary; analysing",
    )
    m.new_interval = True
    m.wake_at(m.obs.now + spec.interval_seconds)
    m.emit(
        "Normal",
        "StepStarted",
        f"Step {step}/{len(spec.steps)}: {weight}% of traffic to the canary "
        f"({canary_replicas(m.obs.total, weight)} canary replicas)",
    )
    if quality_at(step, spec):
        m.run_quality = True


def _record_quality(m: Machine) -> None:
    """Keep a quality verdict for this step that just arrived (a check finishes once: one
    that is not recorded now is lost, and would have to run again)."""
    state, obs = m.state, m.obs
    if obs.quality is not None and (obs.quality.revision, obs.quality.step) == (
        state.canary_revision,
        state.step,
    ):
        verdict_ = obs.quality
        m.set(quality=verdict_)
        m.analysed.append((QUALITY, verdict_.result.lower()))
        if verdict_.result == "Pass":
            m.emit("Normal", "QualityGatePassed", verdict_.message)
        elif verdict_.result == "Fail":
            m.emit("Warning", "QualityGateFailed", verdict_.message)
        else:
            m.emit("Normal", "QualityGateInconclusive", verdict_.message)


def _quality_pending(m: Machine, spec: RolloutSpec) -> QualityVerdict | None:
    """This step's quality verdict (recorded, or just arrived); asks for a run if none."""
    state, obs = m.state, m.obs
    _record_quality(m)
    recorded = m.state.quality
    if recorded is not None and (recorded.revision, recorded.step) == (
        state.canary_revision,
        state.step,
    ):
        if recorded.result != "Inconclusive":
            return recorded
        retry = recorded.at + QUALITY_RETRY_SECONDS
        if obs.now < retry:
            m.wake_at(retry)
            return None
    m.run_quality = True
    return None


def _quality_check(m: Machine, spec: RolloutSpec) -> None:
    found = _quality_pending(m, spec)
    if found is not None and found.result == "Fail":
        rollback(m, "QualityGateFailed", found.message, "RolledBack", QUALITY)
        return
    if found is not None and found.result == "Pass":
        _enter_step(m, spec, 1)
        return
    detail = m.state.quality.message if m.state.quality else "running"
    m.set(message=f"quality gate before traffic: {detail}")
    _deadline_passed(m, spec, f"the quality gate did not conclude ({detail})")


def _analysing(m: Machine, spec: RolloutSpec) -> None:
    state, obs = m.state, m.obs
    quality: QualityVerdict | None = None
    if quality_at(state.step, spec):
        quality = _quality_pending(m, spec)
        if quality is not None and quality.result == "Fail":
            rollback(m, "QualityGateFailed", quality.message, "RolledBack", QUALITY)
            return
    slo = obs.slo
    last = state.analysis
    if (
        slo is None
        and quality is not None
        and last is not None
        and last.step == state.step
        and all(g.result == "Pass" for g in last.gates if g.gate != QUALITY)
    ):
        # The SLO gates passed at the end of the last interval, which only waited for this.
        slo = tuple(g for g in last.gates if g.gate != QUALITY)
    if obs.baseline_missing and slo is None:
        # A new leader has no baseline for the interval under way: start it again.
        m.set(interval_started=obs.now)
        m.new_interval = True
    started = m.state.interval_started or obs.now
    if slo is None:
        m.wake_at(started + spec.interval_seconds)  # the deadline is checked at its end
        return
    gates = list(slo)
    if quality_at(state.step, spec) and quality is None:
        gates.append(GateOutcome(QUALITY, "Inconclusive", "the quality check has not finished"))
    elif quality is not None:
        gates.append(GateOutcome(QUALITY, quality.result, quality.message))
    analysis = Analysis(state.step, obs.now, tuple(gates))
    m.analysed += [(g.gate, g.result.lower()) for g in obs.slo or ()]
    m.set(analysis=analysis, interval_started=obs.now)
    m.new_interval = True
    summary = "; ".join(g.message for g in gates)
    where = f"Step {state.step}/{len(spec.steps)} ({state.weight}%)"
    result = analysis.result
    if result == "Pass":
        m.set(failures=0)
        m.emit("Normal", "AnalysisPassed", f"{where}: {summary}")
        if state.step < len(spec.steps):
            m.set(
                stage="Scaling",
                step_started=obs.now,
                message=f"step {state.step + 1}/{len(spec.steps)}: scaling the canary",
            )
            _scaling(m, spec)
        elif spec.manual_promotion and not m.state.approved:
            m.set(
                stage="AwaitingPromotion",
                phase="Paused",
                message="every step passed; waiting for promotion "
                "(kubectl annotate lisvc NAME ladle.dev/rollout-action=promote)",
            )
            m.emit(
                "Normal",
                "AwaitingPromotion",
                "Every step passed; promote with "
                "kubectl annotate lisvc NAME ladle.dev/rollout-action=promote",
            )
        else:
            start_promotion(m)
        return
    if result == "Fail":
        failures = state.failures + 1
        m.set(failures=failures)
        failed = [g for g in gates if g.result == "Fail"]
        m.emit(
            "Warning",
            "AnalysisFailed",
            f"{where}: {summary} (failure {failures} of {spec.failure_limit})",
        )
        if failures >= spec.failure_limit:
            gate = failed[0]
            reason = "QualityGateFailed" if gate.gate == QUALITY else "SLOGateFailed"
            rollback(m, reason, "; ".join(g.message for g in failed), "RolledBack", gate.gate)
            return
        m.set(message=f"{where}: analysis failed ({failures}/{spec.failure_limit}); again")
    else:
        m.emit("Normal", "AnalysisInconclusive", f"{where}: {summary}")
        m.set(message=f"{where}: inconclusive ({summary}); holding")
    m.wake_at(obs.now + spec.interval_seconds)
    _deadline_passed(m, spec, f"the last analysis was {result.lower()}: {summary}")


def _awaiting(m: Machine) -> None:
    if m.state.approved:
        start_promotion(m)
        return
    m.set(phase="Paused")
