"""Why a runtime pod does not serve, read from its status as the kubelet writes it: the
decision alone (``PodInfo.from_pod``), without a cluster. ``test_pod_facts.py`` and
``tests/cluster/test_local_nodes.py`` see the same statuses come from real kubelets."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ladle.operator.store import PodInfo


def pod(
    state: dict[str, Any],
    *,
    last: dict[str, Any] | None = None,
    restarts: int = 0,
    init: list[dict[str, Any]] | None = None,
    limit: str | None = "1Gi",
) -> dict[str, Any]:
    resources = {"limits": {"memory": limit}} if limit else {}
    return {
        "metadata": {"name": "chat-stable-abc", "namespace": "ns", "labels": {}},
        "spec": {"containers": [{"name": "runtime", "resources": resources}]},
        "status": {
            "phase": "Running",
            "initContainerStatuses": init or [],
            "containerStatuses": [
                {
                    "name": "runtime",
                    "state": state,
                    "lastState": last or {},
                    "restartCount": restarts,
                }
            ],
        },
    }


def terminated(reason: str, code: int) -> dict[str, Any]:
    return {"terminated": {"reason": reason, "exitCode": code}}


def problem(obj: dict[str, Any]) -> tuple[str, str] | None:
    return PodInfo.from_pod(obj).problem


def test_a_container_the_kernel_killed_over_its_limit_reads_as_oom_killed() -> None:
    """The engine's KV cache is most of a runtime's memory: the message says the limit and
    what to change, whether the kubelet shows the killed run or waits in a back-off."""
    expected = (
        "OOMKilled",
        "container runtime was killed by the kernel for exceeding its memory limit (1Gi), "
        "2 restarts so far: raise resources.memory, or lower engine.kvCacheMemory or "
        "engine.maxNumSeqs",
    )
    assert problem(pod(terminated("OOMKilled", 137), restarts=2)) == expected
    backing_off = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}}
    assert problem(pod(backing_off, last=terminated("OOMKilled", 137), restarts=2)) == expected
    unlimited = problem(pod(terminated("OOMKilled", 137), restarts=1, limit=None))
    assert unlimited is not None
    assert "exceeding the node's memory, 1 restart so far" in unlimited[1]


def test_a_crashing_container_reads_as_a_crash_loop_with_its_exit_code() -> None:
    """A 1.37 kubelet shows a container it backs off from as terminated, not as waiting in
    CrashLoopBackOff (seen on the local nodes): it is a crash loop all the same."""
    assert problem(pod(terminated("Error", 3), restarts=4)) == (
        "CrashLoopBackOff",
        "container runtime exited with code 3 (Error), 4 restarts so far",
    )
    # An older kubelet's waiting state, in its own words.
    waiting = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}}
    assert problem(pod(waiting, last=terminated("Error", 3))) == (
        "CrashLoopBackOff",
        "back-off 10s restarting",
    )


def test_a_runtime_that_refuses_its_settings_is_quoted_from_its_last_error_line() -> None:
    """The runtime exits with one JSON error line; the kubelet keeps the log's tail as the
    termination message (FallbackToLogsOnError), and the problem quotes the refusal."""
    refusal = (
        "tensor_parallel_size 4 does not split the model's 9 attention heads over its 3 KV "
        "heads; sizes that do: 2, 3, 9"
    )
    lines = [
        "a line that is not JSON",
        json.dumps({"level": "info", "message": "loading"}),
        json.dumps({"level": "error", "message": "invalid engine setting", "error": refusal}),
    ]
    ended = {"terminated": {"reason": "Error", "exitCode": 2, "message": "\n".join(lines)}}
    assert problem(pod(ended, restarts=1)) == (
        "CrashLoopBackOff",
        f"container runtime exited with code 2 (Error), 1 restart so far: {refusal}",
    )
    waiting = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}}
    assert problem(pod(waiting, last=ended)) == (
        "CrashLoopBackOff",
        f"back-off 10s restarting: {refusal}",
    )
    # Output that holds no error line of ours adds nothing.
    plain = {"terminated": {"reason": "Error", "exitCode": 1, "message": "Segmentation fault"}}
    assert problem(pod(plain)) == (
        "CrashLoopBackOff",
        "container runtime exited with code 1 (Error), 0 restarts so far",
    )


@pytest.mark.parametrize(
    "state",
    [
        {"running": {"startedAt": "2026-12-04T00:00:00Z"}},
        {"waiting": {"reason": "ContainerCreating"}},
    ],
)
def test_a_running_or_starting_container_is_no_problem(state: dict[str, Any]) -> None:
    # An earlier OOM that the container has since recovered from is history, not a problem.
    assert problem(pod(state, last=terminated("OOMKilled", 137), restarts=1)) is None


def test_an_init_container_that_finished_is_its_job_done_and_one_that_failed_is_not() -> None:
    running = {"running": {}}
    done = [{"name": "setup", "state": terminated("Completed", 0)}]
    assert problem(pod(running, init=done)) is None
    failed = [{"name": "setup", "state": terminated("Error", 1), "restartCount": 1}]
    assert problem(pod({"waiting": {"reason": "PodInitializing"}}, init=failed)) == (
        "CrashLoopBackOff",
        "container setup exited with code 1 (Error), 1 restart so far",
    )
