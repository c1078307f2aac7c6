"""The Gateway API Inference Extension's InferencePool, on the real API server with the CRD
from the pinned GAIE module: absent CRDs cost one log line and no pool; present ones give each
InferenceService a pool that selects its pods, kept like any other child.

The tests run in order: the first removes the CRD (a standing cluster may have it from an
earlier run), the second installs it, as a cluster admin would after Ladle."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kube_harness import Kube, OperatorFactory, gone, isvc_manifest, wait_until

from ladle_dev.cluster import gaie

pytestmark = pytest.mark.cluster

CRD = "inferencepools.inference.networking.k8s.io"


def pool(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    shown = kube.kubectl("get", "-n", namespace, "inferencepool", name, "-o", "json")
    return json.loads(shown.stdout) if shown.returncode == 0 else None


def test_without_the_crds_no_pool_is_made_and_one_line_says_so(
    kube: Kube, k8s_namespace: str, operator_factory: OperatorFactory
) -> None:
    removed = kube.kubectl("delete", "crd", CRD, "--ignore-not-found", "--wait=true")
    assert removed.returncode == 0, removed.stderr
    op = operator_factory("inference-pool-absent")
    op.wait_leading()
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    said = [line for line in op.log.read_text().splitlines() if "inferencepools" in line]
    assert len(said) == 1, said
    assert "does not serve inferencepools" in said[0]
    assert "restart the operator" in said[0]
    assert kube.kubectl("get", "crd", CRD).returncode != 0
    op.stop()


def test_each_service_gets_a_pool_of_its_pods_kept_and_collected_with_it(
    kube: Kube, k8s_namespace: str, operator_factory: OperatorFactory
) -> None:
    installed = kube.kubectl("apply", "-f", str(gaie.module_dir() / gaie.POOL_CRD))
    assert installed.returncode == 0, installed.stderr
    established = kube.kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s")
    assert established.returncode == 0, established.stderr
    op = operator_factory("inference-pool-present")
    op.wait_leading()
    kube.apply(
        isvc_manifest("chat", replicas=2, inferencePool={"endpointPicker": {"port": 9003}}),
        k8s_namespace,
    )
    obj = kube.wait_condition(k8s_namespace, "chat", "Ready")
    made = wait_until(lambda: pool(kube, k8s_namespace, "chat"), "the InferencePool")
    assert made["spec"] == {
        "selector": {"matchLabels": {"ladle.dev/inferenceservice": "chat"}},
        "targetPorts": [{"number": 8000}],
        "appProtocol": "http",
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "chat-epp",
            "port": {"number": 9003},
            "failureMode": "FailClose",
        },
    }
    (owner,) = made["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "InferenceService",
        "chat",
        obj["metadata"]["uid"],
    )
    # The pool selects exactly the service's pods, which is what an endpoint picker serves.
    selector = ",".join(f"{k}={v}" for k, v in made["spec"]["selector"]["matchLabels"].items())
    pods = kube.core.list_namespaced_pod(k8s_namespace, label_selector=selector).items
    assert len(pods) == 2
    listed = kube.kubectl("get", "-n", k8s_namespace, "inferencepools", "-o", "name")
    assert listed.stdout.split() == ["inferencepool.inference.networking.k8s.io/chat"]

    deleted = kube.kubectl("delete", "-n", k8s_namespace, "inferencepool/chat", "--wait=true")
    assert deleted.returncode == 0, deleted.stderr
    wait_until(
        lambda: not gone(kube, "-n", k8s_namespace, "inferencepool/chat"),
        "the deleted InferencePool to be recreated",
    )
    kube.wait_event(k8s_namespace, "chat", "Normal", "Restored")

    removed = kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "chat", "--wait=true")
    assert removed.returncode == 0, removed.stderr
    wait_until(
        lambda: gone(kube, "-n", k8s_namespace, "inferencepool/chat"),
        "the InferencePool to be garbage-collected with its service",
    )
    op.stop()
