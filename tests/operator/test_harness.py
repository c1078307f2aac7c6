"""The test harness's own promise: wait_for keeps trying a predicate that raises (an object not
made yet answers 404), which bench/operator_scale.py relied on and crashed without."""

from __future__ import annotations

import pytest
from kube_harness import wait_for


def test_wait_for_retries_a_predicate_that_raises() -> None:
    calls = []

    def not_there_yet() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise LookupError('404: serviceaccounts "default" not found')
        return "found"

    assert wait_for(not_there_yet, "the default ServiceAccount", timeout=5) == "found"
    assert len(calls) == 3


def test_wait_for_names_what_it_waited_for_and_the_last_error() -> None:
    def never() -> None:
        raise LookupError("still 404")

    with pytest.raises(TimeoutError, match="waiting for the thing") as caught:
        wait_for(never, "the thing", timeout=0.3)
    assert isinstance(caught.value.__cause__, LookupError)
