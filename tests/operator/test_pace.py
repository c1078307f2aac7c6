"""Learning a replica's pace (gap between tokens against its batch) from scraped totals."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from paced_pods import PacedPod

from ladle.operator.load import PodLoad
from ladle.operator.pace import HALF_LIFE_SECONDS, Pace, Paces, at_target

TICK = 2.0


def learn(pods: dict[str, PacedPod], batches: list[list[float]], pace: Pace | None = None) -> Pace:
    """Scrape the pods every tick, their batches one row at a time, for a target of 32."""
    pace = pace or Pace()
    for row in batches:
        now = 0.0 if pace.time is None else pace.time + TICK
        scrapes = []
        for (name, pod), b in zip(pods.items(), row, strict=True):
            total, count = pod.step(b, TICK)
            scrapes.append(PodLoad(name, running=b, itl_sum=total, itl_count=count))
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


def scrape(running: float, total: float | None, count: float | None) -> PodLoad:
    return PodLoad("a", running=running, itl_sum=total, itl_count=count)


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


def learn_replica_sets(
    pods: dict[tuple[str, str], PacedPod], batches: list[list[float]], paces: Paces
) -> Paces:
    """``learn`` for pods named by (ReplicaSet, pod), into one ``Paces``."""
    for t, row in enumerate(batches):
        scrapes = []
        for ((replica_set, name), pod), b in zip(pods.items(), row, strict=True):
            total, count = pod.step(b, TICK)
            scrapes.append(
                PodLoad(name, running=b, itl_sum=total, itl_count=count, replica_set=replica_set)
            )
        paces = paces.observe(t * TICK, scrapes, 32, scrapes)
    return paces


def test_each_replica_set_learns_its_own_pace() -> None:
    """A canary of another quantization beside the stable pods: one line through both fits
    neither, so each ReplicaSet has its own."""
    stable, canary = (0.010, 2e-4), (0.004, 4e-5)
    pods = {
        ("chat-stable-1", "s1"): PacedPod(*stable),
        ("chat-stable-1", "s2"): PacedPod(*stable),
        ("chat-canary-2", "c1"): PacedPod(*canary),
    }
    sweep = [[b, 2 * b, 64 - b] for b in range(0, 40, 2)]
    lines = learn_replica_sets(pods, sweep, Paces()).lines()
    assert lines["chat-stable-1"] == pytest.approx(stable, rel=1e-6)
    assert lines["chat-canary-2"] == pytest.approx(canary, rel=1e-6)
    one = {f"p{i}": PacedPod(*pace) for i, pace in enumerate((stable, stable, canary))}
    mixed = learn(one, sweep)
    assert mixed.line is None or mixed.line != pytest.approx(stable, rel=0.1)


def test_a_replaced_replica_set_is_forgotten_but_none_is_at_zero() -> None:
    sweep = [[float(b)] for b in range(0, 64, 2)]
    paces = learn_replica_sets({("old", "o1"): PacedPod(0.010, 2e-4)}, sweep, Paces())
    # Scaled to zero: no pod anywhere, and the line waits for the pods' return.
    at_zero = paces.observe(100.0, [], 32, [])
    assert set(at_zero.lines()) == {"old"}
    # A rollout's first pod: the old ReplicaSet's pace goes with it.
    new_pod = PodLoad("n1", running=4, itl_sum=1.0, itl_count=100.0, replica_set="new")
    rolled = at_zero.observe(102.0, [new_pod], 32, [new_pod])
    assert [name for name, _ in rolled.by_replica_set] == ["new"]
    assert rolled.lines() == {}


@given(
    st.floats(1e-3, 0.1),
    st.floats(0.05, 5.0),
    st.floats(1, 128),
    # A subnormal count underflows to zero; no pod runs 5e-324 requests.
    st.floats(0, 512, allow_subnormal=False),
    st.floats(0, 512),
)
@example(0.0625, 0.5, 1.0, 171.0, 1.6668248207253173e-13)  # one ulp out of order, once
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
