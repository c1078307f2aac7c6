"""How a rollout ends: promotion (the canary takes all traffic, stable moves to its revision,
traffic returns to stable, the canary goes) and rollback (traffic back to stable at once).
Neither is interrupted by a spec change, a pause or an abort once under way."""

from __future__ import annotations

from ladle.operator.rollout_machine import Machine
from ladle.operator.rollout_state import Phase

# After weights move back to stable, how long gateways get to see them before canary pods go.
SETTLE_SECONDS = 3.0


def start_promotion(m: Machine) -> None:
    m.set(
        stage="Promoting",
        phase="Progressing",
        step_started=m.obs.now,
        message="promoting: the canary takes all traffic while stable moves to its revision",
    )
    m.emit(
        "Normal",
        "Promoting",
        f"Every step passed: promoting revision {m.state.canary_revision}",
    )
    finish(m)


def finish(m: Machine) -> None:
    """Promoting and Finalizing, which no spec change, pause or abort interrupts: stable is
    already moving to the canary's revision, or traffic is already back on stable."""
    state, obs = m.state, m.obs
    if state.stage == "Finalizing":
        assert state.settle_until is not None
        if obs.now < state.settle_until:
            m.wake_at(state.settle_until)
            return
        m.set(
            phase=state.outcome,
            stage=None,
            canary_revision=None,
            canary_template=None,
            weight=0,
            step_started=None,
            interval_started=None,
            paused_at=None,
            settle_until=None,
            approved=False,
        )
        return
    if state.stable_revision != state.canary_revision:
        if obs.canary_ready < obs.total:
            held = obs.quota_note if obs.canary_granted < obs.total else None
            m.set(
                message=f"promoting: canary {obs.canary_ready}/{obs.total} replicas available"
                + (f" ({held})" if held else "")
            )
            return
        # The canary serves everything at full size: it becomes the stable revision.
        m.set(
            weight=100,
            stable_revision=state.canary_revision,
            stable_template=state.canary_template,
            message="promoting: the canary takes all traffic; stable moves to its revision",
        )
        return
    if not obs.stable_complete:
        m.set(message="promoting: waiting for the stable replicas on the new revision")
        return
    m.set(
        stage="Finalizing",
        weight=0,
        outcome="Promoted",
        reason=None,
        settle_until=obs.now + SETTLE_SECONDS,
        message=f"promoted revision {state.canary_revision}",
    )
    m.wake_at(obs.now + SETTLE_SECONDS)
    m.emit(
        "Normal",
        "Promoted",
        f"Revision {state.canary_revision} is stable and serves all traffic; removing the canary",
    )


def rollback(m: Machine, reason: str, detail: str, outcome: Phase, gate: str | None) -> None:
    """Traffic back to stable at once; the canary goes after the settle. Stable is untouched."""
    state, now = m.state, m.obs.now
    failed = outcome in ("RolledBack", "Failed")
    message = f"{reason}: {detail}"
    m.set(
        stage="Finalizing",
        weight=0,
        outcome=outcome,
        reason=reason if failed else None,
        failed_revision=state.canary_revision if failed else None,
        settle_until=now + SETTLE_SECONDS,
        paused_at=None,
        phase=outcome if failed else "Progressing",
        message=message if failed else detail,
    )
    m.wake_at(now + SETTLE_SECONDS)
    if failed:
        m.rolled_back = gate
        event = "RolloutFailed" if outcome == "Failed" else "RolledBack"
        m.emit(
            "Warning",
            event,
            f"{message}; traffic is back on stable revision {state.stable_revision}",
        )
    else:
        m.emit("Normal", reason, f"{detail}; removing the canary")
