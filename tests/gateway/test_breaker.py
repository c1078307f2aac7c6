"""The circuit breaker as a pure state machine, driven by explicit times."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.api import BreakerConfig
from ladle.gateway.breaker import Admission, CircuitBreaker, State

CFG = BreakerConfig(
    failure_rate=0.5,
    window_seconds=10,
    minimum_calls=4,
    open_seconds=5.0,
    half_open_probes=2,
    no_ready_seconds=3.0,
)


def feed(b: CircuitBreaker, now: float, outcomes: str) -> None:
    for ch in outcomes:
        assert b.allow(now) is Admission.PASS
        b.record(now, ch == "+")


def test_stays_closed_below_minimum_calls_even_if_all_fail() -> None:
    b = CircuitBreaker(CFG, 0.0)
    feed(b, 0.0, "---")
    assert b.state is State.CLOSED


def test_trips_on_failure_rate_over_the_window() -> None:
    b = CircuitBreaker(CFG, 0.0)
    feed(b, 0.0, "++-")
    assert b.state is State.CLOSED
    assert b.allow(1.0) is Admission.PASS
    transition = b.record(1.0, False)
    assert transition is not None
    assert transition.new is State.OPEN
    assert "50%" in transition.reason
    assert "4 calls" in transition.reason
    assert b.allow(1.5) is Admission.REJECT


def test_old_failures_slide_out_of_the_window() -> None:
    b = CircuitBreaker(CFG, 0.0)
    feed(b, 0.0, "---")
    feed(b, 11.0, "+")  # the three failures are 11 s old: outside the 10 s window
    assert b.state is State.CLOSED
    feed(b, 11.0, "++")
    assert b.state is State.CLOSED


def test_half_opens_after_open_seconds_and_closes_when_probes_succeed() -> None:
    b = CircuitBreaker(CFG, 0.0)
    feed(b, 0.0, "----")
    assert b.state is State.OPEN
    assert b.allow(4.9) is Admission.REJECT
    assert b.allow(5.0) is Admission.PROBE
    assert b.state is State.HALF_OPEN
    assert b.allow(5.0) is Admission.PROBE
    assert b.allow(5.0) is Admission.REJECT  # only two probe slots
    assert b.record(5.1, True, probe=True) is None
    transition = b.record(5.2, True, probe=True)
    assert transition is not None
    assert transition.new is State.CLOSED
    assert b.allow(5.3) is Admission.PASS


def test_a_failed_probe_reopens() -> None:
    b = CircuitBreaker(CFG, 0.0)
    feed(b, 0.0, "----")
    assert b.allow(6.0) is Admission.PROBE
    transition = b.record(6.1, False, probe=True)
    assert transition is not None
    assert transition.new is State.OPEN
    assert b.allow(6.2) is Admission.REJECT
    assert b.allow(11.1) is Admission.PROBE  # open again for open_seconds


def test_a_released_probe_slot_can_be_used_again() -> None:
    b = CircuitBreaker(CFG, 0.0)
    feed(b, 0.0, "----")
    assert b.allow(5.0) is Admission.PROBE
    assert b.allow(5.0) is Admission.PROBE
    b.release_probe()
    assert b.allow(5.0) is Admission.PROBE


def test_no_ready_pods_past_the_hold_opens_and_it_never_half_opens_without_pods() -> None:
    b = CircuitBreaker(CFG, 0.0)
    assert b.observe_ready(0.0, 0, expected=True) is None
    assert b.observe_ready(2.9, 0, expected=True) is None
    transition = b.observe_ready(3.0, 0, expected=True)
    assert transition is not None
    assert transition.new is State.OPEN
    assert "no ready pods" in transition.reason
    assert b.observe_ready(20.0, 0, expected=True) is None
    assert b.state is State.OPEN
    transition = b.observe_ready(21.0, 1, expected=True)
    assert transition is not None
    assert transition.new is State.HALF_OPEN


def test_a_service_scaled_to_zero_does_not_trip() -> None:
    b = CircuitBreaker(CFG, 0.0)
    for t in range(100):
        assert b.observe_ready(float(t), 0, expected=False) is None
    assert b.state is State.CLOSED


def test_disabled_breaker_always_passes() -> None:
    b = CircuitBreaker(BreakerConfig(enabled=False, minimum_calls=1), 0.0)
    feed(b, 0.0, "-" * 50)
    assert b.observe_ready(100.0, 0, expected=True) is None
    assert b.allow(100.0) is Admission.PASS


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 3), st.sampled_from(["ok", "fail", "ready0", "ready1"])),
        max_size=80,
    )
)
def test_invariants_under_any_sequence(steps: list[tuple[float, str]]) -> None:
    """Never more probes in flight than permitted, never a pass while open, and a closed
    breaker that trips only with at least minimum_calls in its window."""
    b = CircuitBreaker(CFG, 0.0)
    now = 0.0
    probes = 0
    for dt, action in steps:
        now += dt
        if action.startswith("ready"):
            b.observe_ready(now, int(action[-1]), expected=True)
            continue
        before = b.state
        admission = b.allow(now)
        if b.state is State.OPEN:
            assert admission is Admission.REJECT
        if admission is Admission.REJECT:
            continue
        if admission is Admission.PROBE:
            probes += 1
            assert probes <= CFG.half_open_probes
        calls = b._calls
        transition = b.record(now, action == "ok", probe=admission is Admission.PROBE)
        if transition is not None and before is State.CLOSED and transition.new is State.OPEN:
            assert "no ready" in transition.reason or calls + 1 >= CFG.minimum_calls
        if transition is not None:
            probes = 0
