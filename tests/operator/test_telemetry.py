"""The operator's per-object gauges: what status says, as series the alerts and the dashboard
read. Unit checks of their bookkeeping, then the real operator against the real cluster."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kube_harness import Kube, OperatorProcess, wait_until
from prometheus_client.parser import text_string_to_metric_families

from ladle.operator.telemetry import Metrics


def status(ready: tuple[str, str], degraded: tuple[str, str], serving: int = 0) -> dict[str, Any]:
    return {
        "readyReplicas": serving,
        "availableReplicas": serving,
        "updatedReplicas": serving,
        "conditions": [
            {"type": "Ready", "status": ready[0], "reason": ready[1]},
            {"type": "Degraded", "status": degraded[0], "reason": degraded[1]},
        ],
        "variants": [{"name": "stable", "requestedReplicas": 2, "desiredReplicas": 1}],
    }


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_conditions_are_one_series_each_and_a_changed_reason_replaces_the_old() -> None:
    m = Metrics()
    svc = {"namespace": "prod", "inferenceservice": "chat"}
    m.observe_isvc("prod", "chat", status(("False", "RollingOut"), ("False", "AsExpected")))
    m.observe_isvc(
        "prod", "chat", status(("False", "InsufficientGPUs"), ("True", "InsufficientGPUs"))
    )
    cond = "ladle_operator_inferenceservice_condition"
    degraded = {**svc, "type": "Degraded", "status": "True", "reason": "InsufficientGPUs"}
    assert value(m, cond, **degraded) == 1
    assert (
        value(m, cond, **{**svc, "type": "Ready", "status": "False", "reason": "RollingOut"})
        is None
    )
    assert value(m, cond, **{**degraded, "status": "False", "reason": "AsExpected"}) is None
    replicas = "ladle_operator_inferenceservice_replicas"
    assert value(m, replicas, **svc, state="requested") == 2
    assert value(m, replicas, **svc, state="desired") == 1
    m.observe_isvc(
        "prod", "chat", status(("True", "Available"), ("False", "AsExpected"), serving=1)
    )
    assert value(m, replicas, **svc, state="ready") == 1
    m.forget_isvc("prod", "chat")
    assert not [s for f in m.registry.collect() for s in f.samples if "chat" in s.labels.values()]


def test_pools_report_a_quota_only_when_they_have_one_and_a_new_leader_starts_clean() -> None:
    m = Metrics()
    counts = {"capacity": 16, "allocatable": 8, "requested": 6, "claimed": 4}
    m.observe_pool("h200", counts, quota=4)
    assert value(m, "ladle_operator_gpupool_quota_gpus", gpupool="h200") == 4
    assert value(m, "ladle_operator_gpupool_allocatable_gpus", gpupool="h200") == 8
    m.observe_pool("h200", counts, quota=None)
    assert value(m, "ladle_operator_gpupool_quota_gpus", gpupool="h200") is None
    assert value(m, "ladle_operator_gpupool_claimed_gpus", gpupool="h200") == 4
    m.observe_isvc("prod", "chat", status(("True", "Available"), ("False", "AsExpected")))
    # A frozen autoscaler left behind by a former leader would keep its alert firing for ever.
    m.autoscaler_frozen.labels("prod", "chat").set(1)
    m.forget_objects()
    names = {s.name for f in m.registry.collect() for s in f.samples}
    assert not {n for n in names if "inferenceservice" in n or "gpupool" in n}
    assert not {n for n in names if n.startswith("ladle_operator_autoscaler_")}


@pytest.mark.cluster
def test_the_operator_exports_conditions_replicas_and_pool_gpus(
    kube: Kube, k8s_namespace: str, operator: OperatorProcess
) -> None:
    pool = f"{k8s_namespace}-metrics"
    kube.apply(
        yaml.safe_dump(
            {
                "apiVersion": "ladle.dev/v1alpha1",
                "kind": "GPUPool",
                "metadata": {"name": pool},
                "spec": {"nodeSelector": {"nvidia.com/gpu.present": "true"}, "quota": {"gpus": 1}},
            }
        )
    )
    try:
        body = {"model": {"name": "smollm2"}, "resources": {"gpus": 1}, "gpuPool": pool}
        kube.apply(
            yaml.safe_dump(
                {
                    "apiVersion": "ladle.dev/v1alpha1",
                    "kind": "InferenceService",
                    "metadata": {"name": "chat"},
                    "spec": {**body, "replicas": 2},
                }
            ),
            k8s_namespace,
        )
        kube.wait_condition(k8s_namespace, "chat", "Degraded", reason="QuotaExceeded")
        svc = {"namespace": k8s_namespace, "inferenceservice": "chat"}
        degraded = {"type": "Degraded", "status": "True", "reason": "QuotaExceeded"}
        expected = {
            (
                "ladle_operator_inferenceservice_condition",
                frozenset({**svc, **degraded}.items()),
            ): 1,
            (
                "ladle_operator_inferenceservice_replicas",
                frozenset({**svc, "state": "requested"}.items()),
            ): 2,
            (
                "ladle_operator_inferenceservice_replicas",
                frozenset({**svc, "state": "desired"}.items()),
            ): 1,
            ("ladle_operator_gpupool_quota_gpus", frozenset({"gpupool": pool}.items())): 1,
            ("ladle_operator_gpupool_requested_gpus", frozenset({"gpupool": pool}.items())): 2,
            ("ladle_operator_gpupool_claimed_gpus", frozenset({"gpupool": pool}.items())): 1,
        }

        def samples() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
            text = operator.get("/metrics")[1]
            return {
                (s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }

        wait_until(
            lambda: expected.items() <= samples().items(),
            "the operator to export the service's and the pool's status",
        )
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "chat")
        wait_until(
            lambda: not [k for k in samples() if ("namespace", k8s_namespace) in k[1]],
            "a deleted service's series to go",
        )
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")
