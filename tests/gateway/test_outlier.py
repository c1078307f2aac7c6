"""Outlier ejection with Envoy's defaults, as a pure function of time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.api import OutlierConfig
from ladle.gateway.outlier import OutlierDetector, max_ejected

ENVOY = OutlierConfig()


def test_envoy_defaults() -> None:
    assert (ENVOY.consecutive_errors, ENVOY.base_ejection_seconds) == (5, 30.0)
    assert (ENVOY.max_ejection_percent, ENVOY.interval_seconds) == (10, 10.0)


def test_ejects_after_five_consecutive_errors_for_thirty_seconds() -> None:
    d = OutlierDetector(ENVOY)
    for i in range(4):
        assert d.record("a", float(i), True, pods=4) is None
    ejection = d.record("a", 4.0, True, pods=4)
    assert ejection is not None
    assert ejection.seconds == 30.0
    assert d.ejected(10.0) == {"a"}
    assert d.ejected(34.0) == frozenset()


def test_a_success_resets_the_count() -> None:
    d = OutlierDetector(ENVOY)
    for _ in range(4):
        d.record("a", 0.0, True, pods=4)
    d.record("a", 0.0, False, pods=4)
    for _ in range(4):
        assert d.record("a", 0.0, True, pods=4) is None
    assert d.ejected(0.0) == frozenset()


def test_ejection_time_grows_with_each_repeat_and_heals_over_healthy_intervals() -> None:
    d = OutlierDetector(ENVOY)
    for _ in range(5):
        d.record("a", 0.0, True, pods=4)
    assert d.ejected(29.0) == {"a"}
    assert d.ejected(30.0) == frozenset()
    second = None
    for _ in range(5):
        second = d.record("a", 31.0, True, pods=4)
    assert second is not None
    assert second.seconds == 60.0
    assert second.times == 2
    # Back at 91 s, then healthy for two intervals: the multiplier falls back to zero.
    d.ejected(91.0)
    d.record("a", 112.0, False, pods=4)
    third = None
    for _ in range(5):
        third = d.record("a", 113.0, True, pods=4)
    assert third is not None
    assert third.seconds == 30.0


def test_never_more_than_the_max_share_but_one_of_two_pods_may_go() -> None:
    assert max_ejected(1, 10) == 0
    assert max_ejected(2, 10) == 1
    assert max_ejected(10, 10) == 1
    assert max_ejected(30, 10) == 3
    assert max_ejected(3, 100) == 2  # always one left
    d = OutlierDetector(ENVOY)
    for pod in ("a", "b"):
        for _ in range(5):
            d.record(pod, 0.0, True, pods=2)
    assert len(d.ejected(1.0)) == 1


def test_the_only_pod_is_never_ejected() -> None:
    d = OutlierDetector(ENVOY)
    for _ in range(50):
        assert d.record("a", 0.0, True, pods=1) is None
    assert d.ejected(0.0) == frozenset()


def test_forgotten_pods_leave_the_ejected_set() -> None:
    d = OutlierDetector(ENVOY)
    for _ in range(5):
        d.record("a", 0.0, True, pods=3)
    d.retain({"b", "c"})
    assert d.ejected(1.0) == frozenset()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 12),
    st.lists(st.tuples(st.integers(0, 11), st.booleans(), st.floats(0, 20)), max_size=200),
)
def test_ejected_share_is_always_bounded(pods: int, events: list[tuple[int, bool, float]]) -> None:
    d = OutlierDetector(OutlierConfig(consecutive_errors=2, max_ejection_percent=25))
    now = 0.0
    for pod, error, dt in events:
        now += dt
        d.record(f"p{pod % pods}", now, error, pods)
        assert len(d.ejected(now)) <= max_ejected(pods, 25) < pods
