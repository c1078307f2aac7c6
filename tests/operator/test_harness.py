"""The suite's one wait helper keeps its promises: it keeps trying a predicate that raises (an
object not made yet answers 404), which bench/operator_scale.py relied on and crashed without;
it fails at once on an assertion; and a timeout says where the wait was stuck."""

from __future__ import annotations

import time

import pytest
from kube_harness import wait_until


def test_wait_until_retries_a_predicate_that_raises() -> None:
    calls = []

    def not_there_yet() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise LookupError('404: serviceaccounts "default" not found')
        return "found"

    assert wait_until(not_there_yet, "the default ServiceAccount", timeout=5) == "found"
    assert len(calls) == 3


def test_a_timeout_names_the_wait_the_last_state_and_the_last_error() -> None:
    calls = []

    def stuck() -> list[str]:
        calls.append(1)
        if len(calls) % 2:
            raise LookupError("still 404")
        return []  # e.g. the Ready pods: none yet

    with pytest.raises(TimeoutError, match="waiting for the thing") as caught:
        wait_until(stuck, "the thing", timeout=0.3, interval=0.01)
    message = str(caught.value)
    assert "last returned []" in message
    assert "last error LookupError('still 404')" in message
    assert isinstance(caught.value.__cause__, LookupError)


def test_an_assertion_in_the_predicate_fails_the_wait_at_once() -> None:
    def verdict() -> None:
        raise AssertionError("the status went backwards")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="went backwards"):
        wait_until(verdict, "a status that only moves forward", timeout=30)
    assert time.monotonic() - started < 25  # not the timeout: a generous bound on one call
