"""The canary analysis' bookkeeping (``operator/canary.py``) that needs no pods."""

from __future__ import annotations

from typing import Any

import pytest

import ladle.operator.canary as canary_module
from ladle.api import ROLLOUT_ACTION_ANNOTATION, InferenceService, parse_isvc
from ladle.kube import ApiError
from ladle.operator.analysis import QualityNumbers
from ladle.operator.canary import CanaryAnalysis, interval_key
from ladle.operator.controller import new_store
from ladle.operator.rollout_state import RolloutState, from_status, to_status
from ladle.operator.store import PodInfo, Store

from .conftest import isvc_object


def test_a_baseline_is_found_again_after_status_round_trips_the_interval_start() -> None:
    """Status keeps milliseconds: the key of the state a decision made must equal the key of
    the state read back from status, or every interval would start again forever."""
    for started in (1_764_547_545.8312345, 1_764_547_545.0004999, 1_764_547_545.9996):
        state = RolloutState(
            phase="Progressing",
            stage="Analysing",
            stable_revision="a",
            canary_revision="b",
            step=1,
            weight=25,
            interval_started=started,
        )
        assert interval_key(from_status(to_status(state))) == interval_key(state)
    moved = RolloutState(canary_revision="b", step=1, interval_started=1_764_547_546.0)
    assert interval_key(moved) != interval_key(RolloutState(canary_revision="b", step=1))


class PatchRecorder:
    """Stands in for the API client: records JSON patches, and answers 422 once told to (the
    value a patch tests has changed)."""

    def __init__(self) -> None:
        self.patches: list[list[dict[str, Any]]] = []
        self.conflict = False

    async def json_patch(self, path: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        self.patches.append(ops)
        if self.conflict:
            raise ApiError(422, "the test operation failed", "Invalid")
        return {}


def with_action(value: str | None) -> InferenceService:
    obj = isvc_object()
    if value is not None:
        obj["metadata"]["annotations"] = {ROLLOUT_ACTION_ANNOTATION: value}
    return parse_isvc(obj)


async def test_an_action_acted_on_is_removed_once_and_never_read_again_from_a_stale_copy() -> None:
    """The reconcile that runs on its own status write may still see the annotation it is
    removing: that copy must not be refused again (a RolloutActionIgnored Warning)."""
    client = PatchRecorder()
    analysis = CanaryAnalysis(Store(), client)  # type: ignore[arg-type]
    state = RolloutState()
    promote = with_action("promote")
    assert (await analysis.measure(promote, state, 0.0)).action == "promote"
    await analysis.clear_action(promote)
    path = "/metadata/annotations/ladle.dev~1rollout-action"
    assert client.patches == [
        [{"op": "test", "path": path, "value": "promote"}, {"op": "remove", "path": path}]
    ]
    assert (await analysis.measure(promote, state, 0.0)).action is None  # the stale copy
    # Another action set meanwhile is read; once gone, the same one counts again.
    assert (await analysis.measure(with_action("abort"), state, 0.0)).action == "abort"
    assert (await analysis.measure(with_action(None), state, 0.0)).action is None
    assert (await analysis.measure(promote, state, 0.0)).action == "promote"


async def test_an_action_changed_before_its_removal_is_kept_for_the_next_reconcile() -> None:
    client = PatchRecorder()
    client.conflict = True
    analysis = CanaryAnalysis(Store(), client)  # type: ignore[arg-type]
    promote = with_action("promote")
    await analysis.clear_action(promote)  # the annotation now says abort: 422, not removed
    assert (await analysis.measure(promote, RolloutState(), 0.0)).action == "promote"


async def test_later_steps_ask_only_the_canary_until_the_stable_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stable answers the quality gate's prompts once per revision: each later step's
    canary is compared with those answers, and a new stable revision is asked again."""
    asked: list[tuple[str, object]] = []

    def evaluate(
        stable: str, canary: str, model: str, name: str | None, prompts: str | None,
        reference: object = None,
    ) -> tuple[QualityNumbers, object]:  # fmt: skip
        asked.append((stable, reference))
        return QualityNumbers(1.0, 0.0, 0.0, 1.0, 37, 4768), reference or f"answers of {stable}"

    monkeypatch.setattr(canary_module, "run_eval", evaluate)
    store = new_store()
    for variant in ("stable", "canary"):
        pod = PodInfo(
            "team-a", f"chat-{variant}-0", "chat", variant, None, {}, True, None,
            base_url=f"http://{variant}:8000",
        )  # fmt: skip
        store.upsert("Pod", ("team-a", pod.name), pod)
    isvc = parse_isvc(isvc_object(spec={"rollout": {"steps": [25, 50, 100]}}))
    analysis = CanaryAnalysis(store, PatchRecorder())  # type: ignore[arg-type]
    template = {"source": {"builtin": {}}, "quantization": "int8"}

    async def step(stable_revision: str, step: int) -> str:
        state = RolloutState(
            stable_revision=stable_revision, stable_template={"source": {"builtin": {}}},
            canary_revision="c1", canary_template=template, step=step,
        )  # fmt: skip
        verdict = await analysis._evaluate(isvc, state, ("c1", step))
        return verdict.result

    assert [await step("s1", n) for n in (1, 2, 3)] == ["Pass"] * 3
    assert [await step("s2", n) for n in (1, 2)] == ["Pass"] * 2
    stable = "http://stable:8000/v1"
    fresh, kept = (stable, None), (stable, f"answers of {stable}")
    assert asked == [fresh, kept, kept, fresh, kept]
    analysis.forget(isvc.meta.uid)
    await step("s2", 3)
    assert asked[-1] == fresh
