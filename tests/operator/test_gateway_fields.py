"""The operator's side of the gateway: model-name conflicts in both services' status, the
gateway's URL in status.url, and status.gateway left to the gateway."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import yaml

from ladle.operator.api import parse_isvc
from ladle.operator.status import (
    ModelConflict,
    VariantObservation,
    derive_isvc_status,
    operator_status,
)
from ladle.operator.testing import Kube, OperatorProcess, wait_for

Builder = Any


def status_with(
    isvc_obj: dict[str, Any], deployment: dict[str, Any], conflict: ModelConflict | None
) -> dict[str, Any]:
    isvc = parse_isvc(isvc_obj)
    variant = VariantObservation(
        name="stable",
        quantization="none",
        image="img",
        deployment_name="chat-stable",
        deployment=deployment,
        requested_replicas=1,
        granted_replicas=1,
        gpu_resource="nvidia.com/gpu",
    )
    return derive_isvc_status(
        isvc, [variant], url="u", selector="s", now="2026-03-01T12:00:00Z", model_conflict=conflict
    )


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in status["conditions"]}


def test_the_newer_claimant_is_not_ready_and_both_are_degraded(
    make_isvc: Builder, make_deployment: Builder
) -> None:
    loser = ModelConflict(owner="team-a/old", others=("team-a/old",), owns=False)
    got = conditions(status_with(make_isvc(), make_deployment(1), loser))
    assert got["Ready"][:2] == ("False", "ModelNameConflict")
    assert got["Degraded"][:2] == ("True", "ModelNameConflict")
    assert "the gateway routes it to team-a/old (the oldest claim)" in got["Ready"][2]
    owner = dataclasses.replace(loser, owner="team-a/chat", others=("team-b/new",), owns=True)
    got = conditions(status_with(make_isvc(), make_deployment(1), owner))
    assert got["Ready"][:2] == ("True", "Available")
    assert got["Degraded"][:2] == ("True", "ModelNameConflict")
    assert (
        "also claimed by team-b/new; this service, the oldest claim, keeps it" in got["Degraded"][2]
    )


def test_the_operator_compares_its_status_without_the_gateways_block() -> None:
    stored = {"url": "u", "gateway": {"breaker": {"state": "Open"}}}
    assert operator_status(stored) == {"url": "u"}


def isvc_yaml(name: str, model: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "ladle.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": {"model": {"name": model}, "resources": {"gpus": 0}},
        }
    )


@pytest.mark.cluster
def test_conflicts_show_in_both_and_clear_and_gateway_status_survives_reconciles(
    kube: Kube, k8s_namespace: str, operator: OperatorProcess
) -> None:
    model = f"shared-{k8s_namespace}"
    kube.apply(isvc_yaml("first", model), k8s_namespace)
    kube.wait_condition(k8s_namespace, "first", "Ready", timeout=90)
    kube.apply(isvc_yaml("second", model), k8s_namespace)
    kube.wait_condition(k8s_namespace, "second", "Ready", "False", "ModelNameConflict", timeout=90)
    kube.wait_condition(k8s_namespace, "first", "Degraded", "True", "ModelNameConflict", timeout=90)
    assert kube.condition(kube.isvc(k8s_namespace, "first"), "Ready")["status"] == "True"

    # The gateway's block, applied under its own field manager, outlives operator reconciles.
    patch = {
        "apiVersion": "ladle.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "first", "namespace": k8s_namespace},
        "status": {"gateway": {"breaker": {"state": "Open", "reason": "test"}}},
    }
    applied = kube.kubectl(
        "apply", "--server-side", "--field-manager=ladle-gateway", "--subresource=status",
        "-f", "-", stdin=yaml.safe_dump(patch),
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    kube.kubectl("delete", "inferenceservice", "second", "-n", k8s_namespace)
    kube.wait_condition(k8s_namespace, "first", "Degraded", "False", timeout=90)
    kube.kubectl("scale", "inferenceservice", "first", "--replicas=2", "-n", k8s_namespace)
    obj = wait_for(
        lambda: (
            (o := kube.isvc(k8s_namespace, "first"))["status"].get("observedGeneration")
            == o["metadata"]["generation"]
            and o
        ),
        "the operator to reconcile the scale",
    )
    assert obj["status"]["gateway"] == {"breaker": {"state": "Open", "reason": "test"}}
