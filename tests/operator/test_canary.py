"""The canary analysis' bookkeeping (``operator/canary.py``) that needs no pods."""

from __future__ import annotations

from ladle.operator.canary import interval_key
from ladle.operator.rollout import RolloutState, from_status, to_status


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
