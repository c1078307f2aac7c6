"""The operator's side of the gateway: the gateway's URL in status.url, and the gateway's
status fields (status.gateway, its ModelNameConflict condition) left to the gateway."""

from __future__ import annotations

import pytest
import yaml
from kube_harness import Kube, OperatorProcess, wait_until

from ladle.operator.conditions import ISVC_CONDITIONS, ISVC_STATUS_FIELDS, owned_status


def test_the_operator_compares_its_status_without_the_gateways_fields() -> None:
    stored = {
        "url": "u",
        "gateway": {"breaker": {"state": "Open"}},
        "conditions": [{"type": "Ready"}, {"type": "ModelNameConflict"}, {"type": "Degraded"}],
    }
    assert owned_status(stored, ISVC_STATUS_FIELDS, ISVC_CONDITIONS) == {
        "url": "u",
        "conditions": [{"type": "Ready"}, {"type": "Degraded"}],
    }


@pytest.mark.cluster
def test_the_gateways_status_fields_survive_operator_reconciles(
    kube: Kube, k8s_namespace: str, operator: OperatorProcess
) -> None:
    isvc = {
        "apiVersion": "ladle.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat"},
        "spec": {"model": {"name": f"m-{k8s_namespace}"}, "resources": {"gpus": 0}},
    }
    kube.apply(yaml.safe_dump(isvc), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready", timeout=90)
    conflict = {
        "type": "ModelNameConflict",
        "status": "True",
        "reason": "KeptByThisService",
        "message": "test",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    written = {"breaker": {"state": "Open", "reason": "test"}}
    patch = {
        "apiVersion": "ladle.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": k8s_namespace},
        "status": {"gateway": written, "conditions": [conflict]},
    }
    applied = kube.kubectl(
        "apply", "--server-side", "--field-manager=ladle-gateway", "--subresource=status",
        "-f", "-", stdin=yaml.safe_dump(patch),
    )  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    kube.kubectl("scale", "inferenceservice", "chat", "--replicas=2", "-n", k8s_namespace)

    def reconciled() -> dict[str, object] | None:
        obj = kube.isvc(k8s_namespace, "chat")
        status = obj["status"]
        done = status.get("observedGeneration") == obj["metadata"]["generation"]
        return obj if done and status.get("availableReplicas") == 2 else None

    obj = wait_until(reconciled, "the operator to reconcile the scale", timeout=90)
    status = obj["status"]
    assert isinstance(status, dict)
    assert status["gateway"] == written
    types = [c["type"] for c in status["conditions"]]
    assert sorted(types) == [
        "Degraded", "ModelNameConflict", "Progressing", "Ready", "Reconciling", "Stalled"
    ]  # fmt: skip
    # Nor does the operator keep rewriting its own status because of them: a reconcile that
    # an annotation causes (no spec change) ends without a write.
    settled: list[str] = []

    def poke() -> None:
        kube.kubectl("annotate", "lisvc", "chat", "test.ladle.dev/poke=1", "-n", k8s_namespace)
        settled.append(kube.isvc(k8s_namespace, "chat")["metadata"]["resourceVersion"])

    operator.reconcile_after(poke)
    assert kube.isvc(k8s_namespace, "chat")["metadata"]["resourceVersion"] == settled[0]
