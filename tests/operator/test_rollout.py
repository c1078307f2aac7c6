"""The canary rollout state machine (``operator/rollout.py``), as a pure function: step, hold,
inconclusive, fail, promote, rollback, deadline, pause, abort, manual promotion, failover."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.api import QualityGateSpec, RolloutSpec
from ladle.operator.analysis import QualityNumbers, quality_outcome
from ladle.operator.revisions import revision_of, template_of
from ladle.operator.rollout import decide
from ladle.operator.rollout_machine import Decision, Observation
from ladle.operator.rollout_state import (
    GateOutcome,
    QualityVerdict,
    RolloutState,
    canary_replicas,
    from_status,
    split,
    to_status,
)
from ladle.runtime.eval.metrics import GATES

STABLE_T = {"source": {"builtin": {}}, "runtime": {"image": "img:1"}}
CANARY_T = {"source": {"builtin": {}}, "runtime": {"image": "img:1"}, "quantization": "int8"}
SPEC = RolloutSpec(steps=(25, 50, 100), interval_seconds=10, min_requests=5, failure_limit=2)
PASS = (GateOutcome("errorRate", "Pass", "error rate 0.0% vs stable 0.0%"),)
FAIL = (GateOutcome("ttftP95", "Fail", "TTFT p95 900ms vs stable 300ms: 3.00x > 1.5x"),)
THIN = (GateOutcome("errorRate", "Inconclusive", "error rate: too few requests"),)


@dataclass
class World:
    """A cluster that does what the operator asks, instantly, and a clock."""

    spec: RolloutSpec | None = SPEC
    total: int = 4
    revision: str = "r1"
    template: dict[str, Any] = field(default_factory=lambda: STABLE_T)
    now: float = 1_000.0
    state: RolloutState = field(default_factory=RolloutState)
    # The pool's room for canary replicas (None: unlimited).
    room: int | None = None
    ready: bool = True  # canary replicas become available as soon as they are granted
    events: list[str] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    def tick(self, **observed: Any) -> Decision:
        asked = split(self.state, self.spec.steps if self.spec else (100,), self.total)[1]
        granted = asked if self.room is None else min(asked, self.room)
        base: dict[str, Any] = {
            "now": self.now,
            "revision": self.revision,
            "template": self.template,
            "rollout": self.spec,
            "total": self.total,
            "canary_asked": asked,
            "canary_granted": granted,
            "canary_ready": granted if self.ready else 0,
            "stable_complete": True,
            "quota_note": None if self.room is None else f"the quota has room for {self.room}",
        }
        base.update(observed)
        decision = decide(self.state, Observation(**base))
        self.state = decision.state
        self.events += [e.reason for e in decision.events]
        self.decisions.append(decision)
        return decision

    def change(self, revision: str = "r2", template: dict[str, Any] | None = None) -> Decision:
        self.revision, self.template = revision, template or CANARY_T
        return self.tick()

    def later(self, seconds: float) -> None:
        self.now += seconds

    def quality(self, result: str = "Pass", **numbers: float) -> QualityVerdict:
        assert self.state.canary_revision is not None
        return QualityVerdict(
            self.state.canary_revision,
            self.state.step,
            result,
            f"quality {result}",
            self.now,  # type: ignore[arg-type]
            numbers,
        )

    def settle(self) -> None:
        """Let the canary scale (a few reconciles) without new measurements."""
        for _ in range(3):
            self.tick()


def started() -> World:
    world = World()
    world.tick()
    world.change()
    world.settle()
    return world


def test_a_new_service_is_stable_at_once_and_a_change_without_rollout_applies_directly() -> None:
    world = World(spec=None)
    world.tick()
    assert world.state.stable_revision == "r1"
    assert world.state.stable_template == STABLE_T
    world.change()
    assert world.state.stable_revision == "r2"
    assert world.state.stable_template == CANARY_T
    assert not world.state.active
    assert world.state.phase == "Idle"
    assert world.events == []


def test_canary_replicas_follow_the_weight_and_stable_keeps_all() -> None:
    assert [canary_replicas(4, w) for w in (5, 25, 50, 100)] == [1, 1, 2, 4]
    assert [canary_replicas(10, w) for w in (5, 25, 50, 100)] == [1, 3, 5, 10]
    assert canary_replicas(0, 50) == 0  # scaled to zero: nothing to compare
    world = started()
    assert split(world.state, SPEC.steps, 4) == (4, 1)
    # The autoscaler's total is what both follow.
    assert split(world.state, SPEC.steps, 10) == (10, 3)


def test_promotes_through_every_step_with_quality_before_traffic_and_again_at_50() -> None:
    world = started()
    assert world.state.stage == "QualityCheck"
    assert world.state.weight == 0  # no user traffic before the quality gate
    assert world.decisions[-1].run_quality
    world.tick(quality=world.quality(top1Agreement=0.99))
    assert (world.state.stage, world.state.step, world.state.weight) == ("Analysing", 1, 25)
    assert world.state.weights() == [
        {"variant": "stable", "weight": 75},
        {"variant": "canary", "weight": 25},
    ]
    assert world.decisions[-1].new_interval
    assert world.decisions[-1].wake_in == 10
    # Nothing happens before the interval ends.
    world.later(5)
    assert world.tick().state.step == 1
    world.later(5)
    world.tick(slo=PASS)
    world.settle()
    assert (world.state.step, world.state.weight) == (2, 50)
    assert split(world.state, SPEC.steps, 4) == (4, 2)
    assert world.decisions[-3].run_quality  # the recheck at 50%
    world.later(10)
    world.tick(slo=PASS)  # the quality check is still running: inconclusive, hold
    assert world.state.step == 2
    assert world.state.analysis is not None
    assert world.state.analysis.result == "Inconclusive"
    # It arrives: the step passes on the interval that only waited for it.
    world.tick(quality=world.quality())
    world.settle()
    assert (world.state.step, world.state.weight) == (3, 100)
    world.later(10)
    world.tick(slo=PASS)
    assert world.state.stage == "Promoting"
    # The canary serves everything at full size and becomes stable; stable follows.
    assert world.state.stable_revision == "r2"
    assert world.state.stable_template == CANARY_T
    assert world.state.weights() == [
        {"variant": "stable", "weight": 0},
        {"variant": "canary", "weight": 100},
    ]
    world.tick(stable_complete=False)
    assert world.state.stage == "Promoting"
    world.tick(stable_complete=True)
    assert world.state.stage == "Finalizing"
    assert world.state.weights()[0] == {"variant": "stable", "weight": 100}
    world.later(1)
    assert world.tick().state.active  # the settle lets every gateway see the weights
    world.later(3)
    world.tick()
    assert not world.state.active
    assert world.state.phase == "Promoted"
    assert world.state.weights() == []
    assert world.events == [
        "RolloutStarted",
        "QualityGatePassed",
        "StepStarted",
        "AnalysisPassed",
        "StepStarted",
        "AnalysisInconclusive",
        "QualityGatePassed",
        "AnalysisPassed",
        "StepStarted",
        "AnalysisPassed",
        "Promoting",
        "Promoted",
    ]


def test_quality_failure_rolls_back_before_traffic_and_the_revision_is_not_retried() -> None:
    world = started()
    verdict = world.quality("Fail")
    verdict = replace(verdict, message="top-1 agreement 0.81 < 0.95 (KLD 0.21)")
    decision = world.tick(quality=verdict)
    assert decision.rolled_back == "quality"
    assert world.state.phase == "RolledBack"
    assert world.state.reason == "QualityGateFailed"
    assert world.state.message == "QualityGateFailed: top-1 agreement 0.81 < 0.95 (KLD 0.21)"
    assert world.state.failed_revision == "r2"
    assert world.state.weight == 0
    assert world.state.stable_revision == "r1"  # untouched
    world.later(5)
    world.tick()
    assert not world.state.active
    world.later(600)
    world.tick()
    assert not world.state.active, "a failed revision is not tried again"
    assert world.state.phase == "RolledBack"
    world.tick(action="retry")
    assert world.state.active
    assert world.decisions[-1].action_used
    assert world.events[-2:] == ["RolloutRetried", "RolloutStarted"]


def test_a_new_spec_after_a_rollback_starts_again_and_going_back_clears_degraded() -> None:
    world = started()
    world.tick(quality=world.quality("Fail"))
    world.later(5)
    world.tick()
    world.change("r3", {**CANARY_T, "engine": {"maxNumSeqs": 8}})
    assert world.state.canary_revision == "r3"
    assert world.state.failed_revision is None
    world2 = started()
    world2.tick(quality=world2.quality("Fail"))
    world2.later(5)
    world2.tick()
    world2.change("r1", STABLE_T)  # the user reverts the spec
    assert world2.state.phase == "Idle"
    assert world2.state.failed_revision is None
    assert world2.state.reason is None


def _at_step_one() -> World:
    world = started()
    world.tick(quality=world.quality())
    return world


def test_slo_failures_roll_back_at_the_failure_limit_and_a_pass_resets_the_count() -> None:
    world = _at_step_one()
    world.later(10)
    world.tick(slo=FAIL)
    assert world.state.failures == 1
    assert world.state.step == 1
    world.later(10)
    world.tick(slo=PASS)
    world.settle()
    assert (world.state.failures, world.state.step) == (0, 2)
    world.later(10)
    world.tick(slo=FAIL)
    world.later(10)
    decision = world.tick(slo=FAIL)
    assert decision.rolled_back == "ttftP95"
    assert world.state.reason == "SLOGateFailed"
    assert "TTFT p95 900ms vs stable 300ms" in world.state.message
    assert world.state.weight == 0
    assert ("ttftP95", "fail") in decision.analysed


def test_a_failed_quality_recheck_after_traffic_moved_rolls_back_to_stable() -> None:
    """The recheck at 50% fails, with user traffic already on the canary: all of it goes back
    to stable at once, and the reason names the gate and what it measured."""
    world = _at_step_one()
    world.later(10)
    world.tick(slo=PASS)
    world.settle()
    assert (world.state.step, world.state.weight) == (2, 50)
    assert world.decisions[-3].run_quality  # the recheck at 50%
    numbers = QualityNumbers(
        top1=0.81, kld=0.21, ppl_increase=0.4, greedy=0.2, prompts=6, tokens=203
    )
    outcome = quality_outcome(numbers, GATES["int8"])
    verdict = QualityVerdict(
        "r2", 2, outcome.result, outcome.message, world.now, numbers.as_status()
    )
    world.later(4)  # the check ends before the interval does
    decision = world.tick(quality=verdict)
    assert decision.rolled_back == "quality"
    assert world.state.phase == "RolledBack"
    assert world.state.reason == "QualityGateFailed"
    assert world.state.message == (
        "QualityGateFailed: top-1 agreement 0.81 < 0.97; KLD 0.21 > 0.005 "
        "(perplexity +40.0%; 6 prompts, 203 tokens)"
    )
    assert world.state.weights() == [
        {"variant": "stable", "weight": 100},
        {"variant": "canary", "weight": 0},
    ]
    assert world.state.quality == verdict
    assert world.state.stable_revision == "r1"  # untouched
    assert world.state.failed_revision == "r2"
    assert world.events[-2:] == ["QualityGateFailed", "RolledBack"]
    world.later(3)
    world.tick()
    assert not world.state.active
    assert world.state.weights() == []  # no weights: the gateway sends everything to stable
    assert split(world.state, SPEC.steps, 4) == (4, 0)
    assert world.state.reason == "QualityGateFailed"
    status = to_status(world.state)
    assert status["quality"]["top1Agreement"] == 0.81
    assert status["quality"]["step"] == 2


def test_a_quality_verdict_that_arrives_while_paused_is_kept() -> None:
    """The recheck at 50% starts with the step; paused meanwhile, its verdict is recorded, not
    lost, and the resumed rollout does not run the check again."""
    world = _at_step_one()
    world.later(10)
    world.tick(slo=PASS)
    world.settle()
    assert world.state.step == 2
    world.spec = replace(SPEC, paused=True)
    world.tick()
    assert world.state.phase == "Paused"
    world.later(5)
    decision = world.tick(quality=world.quality())
    assert world.state.phase == "Paused"
    assert world.state.quality is not None
    assert (world.state.quality.step, world.state.quality.result) == (2, "Pass")
    assert not decision.run_quality
    world.spec = SPEC
    resumed = world.tick()
    assert world.state.phase == "Progressing"
    assert not resumed.run_quality, "the check already passed at this step"
    world.later(10)
    world.tick(slo=PASS)
    world.settle()
    assert (world.state.step, world.state.weight) == (3, 100)
    assert world.events.count("QualityGatePassed") == 2


def test_inconclusive_holds_the_step_until_the_progress_deadline_fails_it() -> None:
    world = World(spec=replace(SPEC, progress_deadline_seconds=35))
    world.tick()
    world.change()
    world.settle()
    world.tick(quality=world.quality())
    for _ in range(3):
        world.later(10)
        world.tick(slo=THIN)
        assert world.state.step == 1
        assert world.state.phase == "Progressing"
    world.later(10)
    decision = world.tick(slo=THIN)
    assert world.state.phase == "Failed"
    assert world.state.reason == "ProgressDeadlineExceeded"
    assert decision.rolled_back == "deadline"
    assert "too few requests" in world.state.message
    assert world.events.count("AnalysisInconclusive") == 4


def test_a_pool_without_room_holds_the_rollout_with_the_pools_reason() -> None:
    world = World(room=0, spec=replace(SPEC, progress_deadline_seconds=60))
    world.tick()
    world.change()
    world.settle()
    assert world.state.stage == "Scaling"
    assert world.state.weight == 0
    assert "the quota has room for 0" in world.state.message
    assert world.events.count("RolloutHeld") == 1  # once, not on every reconcile
    world.room = None
    world.tick()
    assert world.state.stage == "QualityCheck"
    # Without room for the next step's replicas, the weight does not move either.
    world.tick(quality=world.quality())
    world.room = 1
    world.later(10)
    world.tick(slo=PASS)
    world.settle()
    assert (world.state.step, world.state.weight) == (1, 25)
    assert world.state.stage == "Scaling"
    world.later(61)
    world.tick()
    assert world.state.phase == "Failed"


def test_pause_holds_everything_and_resume_restarts_the_interval_and_the_deadline_clock() -> None:
    world = _at_step_one()
    started_at = world.state.step_started
    assert started_at is not None
    world.spec = replace(SPEC, paused=True)
    world.later(10)
    world.tick(slo=PASS)
    assert world.state.phase == "Paused"
    assert (world.state.step, world.state.weight) == (1, 25)
    world.later(1000)
    world.tick()
    assert world.state.phase == "Paused"
    world.spec = SPEC
    # The interval under way ended during the pause, so the resuming reconcile measured it: that
    # verdict spans the pause and must not move the step.
    decision = world.tick(slo=PASS)
    assert world.state.phase == "Progressing"
    assert (world.state.step, world.state.stage) == (1, "Analysing")
    assert "AnalysisPassed" not in world.events
    assert decision.new_interval
    assert world.state.step_started == started_at + 1000  # paused from 1010 to 2010
    assert "paused" not in world.state.message
    assert world.state.interval_started == world.now
    world.later(10)
    world.tick(slo=PASS)
    world.settle()
    assert world.state.step == 2
    assert world.events.count("RolloutPaused") == 1
    assert world.events.count("RolloutResumed") == 1


def test_abort_rolls_back_and_holds_the_revision() -> None:
    world = _at_step_one()
    decision = world.tick(action="abort")
    assert decision.action_used
    assert decision.rolled_back == "abort"
    assert world.state.phase == "RolledBack"
    assert world.state.reason == "Aborted"
    assert world.state.weight == 0
    world.later(5)
    world.tick()
    assert not world.state.active
    assert world.state.failed_revision == "r2"


def test_manual_promotion_waits_paused_until_promoted() -> None:
    world = World(spec=replace(SPEC, steps=(50,), manual_promotion=True))
    world.tick()
    world.change()
    world.settle()
    world.tick(quality=world.quality())
    world.later(10)
    world.tick(slo=PASS, quality=world.quality())
    assert world.state.stage == "AwaitingPromotion"
    assert world.state.phase == "Paused"
    world.later(10_000)
    world.tick()
    assert world.state.stage == "AwaitingPromotion", "no deadline while a human decides"
    decision = world.tick(action="promote")
    assert decision.action_used
    assert world.state.stage == "Promoting"
    assert world.events[-3:] == ["AwaitingPromotion", "PromotionApproved", "Promoting"]


def test_a_promotion_approved_early_does_not_wait() -> None:
    world = World(spec=replace(SPEC, steps=(50,), manual_promotion=True))
    world.tick()
    world.change()
    world.settle()
    world.tick(action="promote")
    assert world.state.approved
    world.tick(quality=world.quality())
    world.later(10)
    world.tick(slo=PASS, quality=world.quality())
    assert world.state.stage == "Promoting"


def test_promotion_is_not_interrupted_by_abort_or_a_spec_change() -> None:
    world = World(spec=replace(SPEC, steps=(100,)))
    world.tick()
    world.change()
    world.settle()
    world.tick(quality=world.quality())
    world.later(10)
    world.tick(slo=PASS, quality=world.quality())  # 100% is also the recheck step
    assert world.state.stage == "Promoting"
    decision = world.tick(action="abort", stable_complete=False)
    assert not decision.action_used
    assert world.state.stage == "Promoting"
    world.revision, world.template = "r3", STABLE_T
    world.tick(stable_complete=True)
    world.later(5)
    world.tick()
    assert world.state.phase == "Promoted"
    assert world.state.stable_revision == "r2"
    # The next reconcile starts the newer revision's rollout.
    world.tick()
    assert world.state.canary_revision == "r3"


def test_a_spec_change_mid_rollout_restarts_and_a_revert_cancels() -> None:
    world = _at_step_one()
    world.change("r3", {**CANARY_T, "engine": {"maxNumSeqs": 4}})
    assert (world.state.canary_revision, world.state.step, world.state.weight) == ("r3", 0, 0)
    assert world.events[-2:] == ["RolloutRestarted", "RolloutStarted"]
    world.settle()
    world.change("r1", STABLE_T)
    assert world.state.stage == "Finalizing"
    assert world.state.weight == 0
    world.later(5)
    world.tick()
    assert not world.state.active
    assert world.state.phase == "Idle"
    assert world.state.failed_revision is None


def test_removing_spec_rollout_mid_rollout_applies_the_new_revision_directly() -> None:
    world = _at_step_one()
    world.spec = None
    world.tick()
    assert world.state.stable_revision == "r2"
    assert world.state.weight == 0
    world.later(5)
    world.tick()
    assert not world.state.active
    assert world.state.phase == "Idle"


def test_a_new_leader_resumes_at_the_same_step_with_the_same_weights() -> None:
    world = _at_step_one()
    world.later(10)
    world.tick(slo=PASS)
    world.settle()
    persisted = to_status(world.state)
    resumed = from_status(persisted)
    assert to_status(resumed) == persisted
    assert resumed.weights() == world.state.weights()
    assert (resumed.step, resumed.stage) == (2, "Analysing")
    # It has no metrics baseline: that interval starts again, at the same step and weights.
    world.state = resumed
    world.later(3)
    decision = world.tick(baseline_missing=True)
    assert decision.new_interval
    assert world.state.interval_started == world.now
    assert (world.state.step, world.state.weight) == (2, 50)


def test_status_round_trip_of_every_field() -> None:
    world = started()
    world.tick(quality=world.quality("Pass", top1Agreement=0.99, kld=0.001))
    world.later(10)
    world.tick(slo=FAIL)
    world.tick(action="promote")
    status = to_status(world.state)
    assert status["quality"]["top1Agreement"] == 0.99
    assert status["lastAnalysis"]["result"] == "Fail"
    assert status["consecutiveFailures"] == 1
    assert status["promotionApproved"] is True
    assert from_status(status) == world.state


def test_the_quality_gate_can_be_turned_off_or_only_run_before_traffic() -> None:
    world = World(spec=replace(SPEC, quality=QualityGateSpec(enabled=False)))
    world.tick()
    world.change()
    world.settle()
    assert (world.state.stage, world.state.step) == ("Analysing", 1)
    once = World(spec=replace(SPEC, quality=QualityGateSpec(recheck_at_weight=0)))
    once.tick()
    once.change()
    once.settle()
    once.tick(quality=once.quality())
    once.later(10)
    once.tick(slo=PASS)
    once.settle()
    assert once.state.step == 2
    once.later(10)
    once.tick(slo=PASS)
    once.settle()
    assert once.state.step == 3, "no recheck at 50%"


OBSERVED = st.fixed_dictionaries(
    {
        "advance": st.floats(0, 20),
        "slo": st.sampled_from([None, PASS, FAIL, THIN]),
        "quality": st.sampled_from([None, "Pass", "Fail", "Inconclusive"]),
        "action": st.sampled_from([None, None, None, "promote", "abort", "retry"]),
        "revision": st.sampled_from(["r1", "r2", "r2", "r2", "r3"]),
        "paused": st.booleans(),
        "ready": st.booleans(),
        "room": st.sampled_from([None, None, 0, 1]),
    }
)


@settings(max_examples=200, deadline=None)
@given(st.lists(OBSERVED, min_size=1, max_size=60))
def test_invariants_hold_for_any_sequence_of_observations(steps: list[dict[str, Any]]) -> None:
    templates = {"r1": STABLE_T, "r2": CANARY_T, "r3": {**CANARY_T, "engine": {"seed": 1}}}
    world = World()
    world.tick()
    promoted_from: set[str] = set()
    for obs in steps:
        world.later(obs["advance"])
        world.revision, world.template = obs["revision"], templates[obs["revision"]]
        world.spec = replace(SPEC, paused=obs["paused"], progress_deadline_seconds=40)
        world.ready, world.room = obs["ready"], obs["room"]
        before = world.state
        quality = None
        if obs["quality"] and world.state.canary_revision:
            quality = world.quality(obs["quality"])
        decision = world.tick(slo=obs["slo"], quality=quality, action=obs["action"])
        state = decision.state
        weights = state.weights()
        if state.active:
            assert sum(w["weight"] for w in weights) == 100
            assert state.weight in {0, *SPEC.steps, 100}
            assert state.canary_revision != before.stable_revision or state.stage in (
                "Promoting",
                "Finalizing",
            )
        else:
            assert weights == []
        # Stable changes only by a promotion (the canary's revision) or a direct apply.
        if state.stable_revision != before.stable_revision:
            assert state.stable_revision == before.canary_revision or world.spec is None
            promoted_from.add(str(before.stable_revision))
        # Traffic moves only one step at a time, and never while paused.
        if state.weight > before.weight and before.stage != "Promoting":
            assert not obs["paused"]
            assert before.weight == 0 or SPEC.steps.index(state.weight) == (
                SPEC.steps.index(before.weight) + 1
            )
        # A failed revision never starts again without a retry or another spec first.
        if (
            state.canary_revision is not None
            and state.canary_revision == before.failed_revision
            and not before.active
        ):
            assert obs["action"] == "retry"
        if state.phase in ("RolledBack", "Failed"):
            assert state.failed_revision is not None
            assert state.reason is not None
        # What a leader reads back, it writes back unchanged (no status write loops).
        assert to_status(from_status(to_status(state))) == to_status(state)


# -- adapters ------------------------------------------------------------------------------


def _lora(*adapters: tuple[str, str], **spec: Any) -> dict[str, Any]:
    listed = [
        {"name": n, "source": {"pvc": {"claimName": "loras", "path": p}}} for n, p in adapters
    ]
    return template_of({"model": {"name": "m"}, "adapters": listed, **spec}, "img:1")


def _lora_world(*adapters: tuple[str, str]) -> World:
    t = _lora(*adapters)
    world = World(revision=revision_of(t), template=t)
    world.tick()
    return world


def _move(world: World, t: dict[str, Any]) -> Decision:
    return world.change(revision_of(t), t)


def _names(t: dict[str, Any] | None) -> dict[str, str]:
    assert t is not None
    return {a["name"]: a["source"]["pvc"]["path"] for a in t["adapters"]}


def test_adding_or_removing_an_adapter_applies_at_once_without_a_canary() -> None:
    world = _lora_world(("sql", "sql/v1"))
    added = _lora(("sql", "sql/v1"), ("fr", "fr/v1"))
    _move(world, added)
    assert not world.state.active
    assert (world.state.stable_revision, world.state.stable_template) == (
        revision_of(added),
        added,
    )
    assert world.decisions[-1].events[0].message == "Adapters added fr, on every variant"
    _move(world, _lora(("fr", "fr/v1")))
    assert not world.state.active
    assert world.events[-1] == "AdaptersUpdated"
    assert _names(world.state.stable_template) == {"fr": "fr/v1"}


def test_a_new_adapter_version_is_a_canary_and_stable_takes_the_names_added_beside_it() -> None:
    world = _lora_world(("sql", "sql/v1"), ("old", "old/v1"))
    _move(world, _lora(("sql", "sql/v2"), ("fr", "fr/v1")))
    assert world.state.stage == "Scaling"
    assert _names(world.state.canary_template) == {"sql": "sql/v2", "fr": "fr/v1"}
    # Both variants answer to the same names; only sql's version differs.
    assert _names(world.state.stable_template) == {"sql": "sql/v1", "fr": "fr/v1"}
    assert world.state.stable_revision == revision_of(world.state.stable_template)
    world.settle()
    # Mid-rollout, an adapter added is taken by both variants and the rollout goes on.
    world.tick(quality=world.quality())
    step = (world.state.step, world.state.weight)
    _move(world, _lora(("sql", "sql/v2"), ("fr", "fr/v1"), ("de", "de/v1")))
    assert (world.state.step, world.state.weight) == step
    assert world.state.canary_revision == world.revision
    assert _names(world.state.stable_template) == {"sql": "sql/v1", "fr": "fr/v1", "de": "de/v1"}
    assert "RolloutRestarted" not in world.events
    # Removing the adapter under test leaves nothing to test: the canary goes.
    _move(world, _lora(("fr", "fr/v1"), ("de", "de/v1")))
    assert world.state.stage == "Finalizing"
    assert world.state.weight == 0
    assert world.events[-1] == "RolloutCancelled"
    world.later(5)
    world.tick()
    assert not world.state.active
    assert world.state.phase == "Idle"
    assert world.state.stable_revision == world.revision


def test_a_rolled_back_adapter_version_is_held_and_reverting_it_clears_the_rollback() -> None:
    world = _lora_world(("sql", "sql/v1"))
    _move(world, _lora(("sql", "sql/v2")))
    world.settle()
    world.tick(quality=world.quality("Fail"))
    world.later(5)
    world.tick()
    assert world.state.phase == "RolledBack"
    assert _names(world.state.stable_template) == {"sql": "sql/v1"}
    world.later(600)
    world.tick()
    assert not world.state.active, "a failed version is not tried again"
    _move(world, _lora(("sql", "sql/v1"), ("fr", "fr/v1")))
    assert not world.state.active
    assert world.state.phase == "Idle"
    assert world.state.failed_revision is None


def test_an_infinite_quality_number_is_left_out_of_status_and_said_in_the_message() -> None:
    verdict = QualityVerdict(
        "r2", 0, "Fail", "adapter sql: perplexity +inf% > +10%", 1_000.0,
        {"perplexityIncrease": float("inf"), "kld": 3.5},
    )  # fmt: skip
    written = to_status(RolloutState(quality=verdict))
    assert json.loads(json.dumps(written, allow_nan=False))["quality"]["kld"] == 3.5
    assert "perplexityIncrease" not in written["quality"]
