"""Learning a replica's pace (gap between tokens against its batch) from scraped totals."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from paced_pods import PacedPod

from ladle.operator.pace import HALF_LIFE_SECONDS, Pace, at_target
from ladle.operator.scaling import PodMetrics

TICK = 2.0


def learn(pods: dict[str, PacedPod], batches: list[list[float]], pace: Pace | None = None) -> Pace:
    """Scrape the pods every tick, their batches one row at a time, for a target of 32."""
    pace = pace or Pace()
    for row in batches:
        now = 0.0 if pace.time is None else pace.time + TICK
        scrapes = []
        for (name, pod), b in zip(pods.items(), row, strict=True):
            total, count = pod.step(b, TICK)
            scrapes.append(PodMetrics(name, running=b, itl_sum=total, itl_count=count))
        pace = pace.observe(now, scrapes, target=32)
    return pace


def test_a_spread_of_batches_recovers_the_line() -> None:
    pods = {"a": PacedPod(0.007, 1e-4), "b": PacedPod(0.007, 1e-4)}
    pace = learn(pods, [[b, 2 * b] for b in range(0, 40, 2)])
    line = pace.line
    assert line is not None
    assert line == pytest.approx((0.007, 1e-4), rel=1e-6)


def test_no_fit_from_batches_that_are_all_alike() -> None:
    pods = {"a": PacedPod(0.007, 1e-4)}
    assert learn(pods, [[32.0]] * 50).line is None
    # Spread, but too little for the target's scale.
    assert learn({"b": PacedPod(0.007, 1e-4)}, [[30.0 + t % 3] for t in range(50)]).line is None


def test_no_fit_from_too_few_samples() -> None:
    pace = learn({"a": PacedPod(0.007, 1e-4)}, [[b] for b in (1.0, 60.0, 5.0, 50.0)])
    assert pace.line is None


def test_a_gap_that_does_not_grow_with_the_batch_is_no_fit() -> None:
    pace = learn({"a": PacedPod(0.01, -1e-5)}, [[float(b)] for b in range(0, 60, 3)])
    assert pace.line is None


def scrape(running: float, total: float | None, count: float | None) -> PodMetrics:
    return PodMetrics("a", running=running, itl_sum=total, itl_count=count)


def test_new_restarted_idle_and_nonsensical_pods_add_no_sample() -> None:
    pace = Pace().observe(0.0, [scrape(4, 1.0, 100.0)], target=32)
    assert pace.weight == 0  # first sight: nothing to take a difference from
    for later in (
        scrape(4, 0.5, 10.0),  # restarted: its totals went back
        scrape(0, 1.0, 100.0),  # no token since
        scrape(4, math.nan, 200.0),
        scrape(4, None, None),  # an old runtime without the histogram
    ):
        assert pace.observe(TICK, [later], target=32).weight == 0, later
    assert pace.observe(TICK, [scrape(4, 1.5, 150.0)], target=32).weight == 1


def test_a_line_holds_once_the_batches_settle() -> None:
    """Hours at the target fade the sweep that found the line, not the line."""
    pods = {"a": PacedPod(0.007, 1e-4)}
    pace = learn(pods, [[float(b)] for b in range(0, 64, 2)])
    settled = learn(pods, [[32.0 + t % 3] for t in range(int(10 * HALF_LIFE_SECONDS / TICK))], pace)
    assert settled.line == pytest.approx((0.007, 1e-4), rel=1e-6)


def test_old_samples_fade_so_a_new_pace_takes_over() -> None:
    """A rollout to a faster variant: after a few half-lives the fit follows the new pods."""
    sweep = [[float(b)] for b in range(0, 64, 2)] * 10
    pace = learn({"old": PacedPod(0.010, 2e-4)}, sweep)
    ticks = int(4 * HALF_LIFE_SECONDS / TICK)
    pace = learn({"new": PacedPod(0.005, 1e-4)}, (sweep * 10)[:ticks], pace)
    line = pace.line
    assert line is not None
    assert line == pytest.approx((0.005, 1e-4), rel=0.1)


@given(
    st.floats(1e-3, 0.1),
    st.floats(0.05, 5.0),
    st.floats(1, 128),
    st.floats(0, 512),
    st.floats(0, 512),
)
def test_at_the_targets_pace_a_count_keeps_its_order_and_is_itself_at_the_target(
    a: float, slowdown: float, target: float, low: float, extra: float
) -> None:
    """More running requests are never fewer at the target's pace; at the target they are the
    same number; above it, fewer (they are slow from crowding); below it, more."""
    line = (a, a * slowdown / target)
    assert at_target(low + extra, target, line) >= at_target(low, target, line)
    assert at_target(target, target, line) == pytest.approx(target)
    if low > target * 1.01:
        assert at_target(low, target, line) < low
    elif 0 < low < target * 0.99:
        assert at_target(low, target, line) > low
