"""High availability: two operators, one Lease, exactly one active, and failover in time."""

from __future__ import annotations

import signal
import time

import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient

from ladle.cluster.pytest_plugin import KubeCluster
from ladle.operator.testing import Kube, OperatorFactory, wait_for

pytestmark = pytest.mark.cluster

FAILOVER_TARGET_SECONDS = 30


def isvc(name: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "ladle.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": {"model": {"name": "smollm2"}},
        }
    )


def holder(api: ApiClient, namespace: str) -> str:
    lease = client.CoordinationV1Api(api).read_namespaced_lease("ladle-operator", namespace)
    return str(lease.spec.holder_identity or "")


def test_killing_the_active_operator_fails_over(
    operator_factory: OperatorFactory,
    kube: Kube,
    k8s_namespace: str,
    k8s_api: ApiClient,
    ladle_chart: str,
) -> None:
    first = operator_factory("ha-first")
    first.wait_leading()
    second = operator_factory("ha-second")
    wait_for(lambda: second.get("/readyz")[0] == 200, "the standby to be ready")
    # The standby stays passive: no leadership, no reconciles.
    for _ in range(5):
        assert second.metric("ladle_operator_leader") == 0.0
        time.sleep(0.2)
    assert not second.metric("ladle_operator_reconcile_total")
    assert holder(k8s_api, ladle_chart) == "ha-first"

    kube.apply(isvc("before"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "before", "Ready")
    settled = kube.isvc(k8s_namespace, "before")["metadata"]["resourceVersion"]

    first.stop(signal.SIGKILL)  # no chance to release the Lease
    killed = time.monotonic()
    second.wait_leading(timeout=FAILOVER_TARGET_SECONDS)
    failover = time.monotonic() - killed
    print(f"\nfailover after SIGKILL took {failover:.1f}s")
    assert failover < FAILOVER_TARGET_SECONDS
    assert holder(k8s_api, ladle_chart) == "ha-second"

    kube.apply(isvc("after"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "after", "Ready")
    assert second.metric("ladle_operator_reconcile_total", kind="isvc", result="ok")
    # The new leader found "before" exactly as it should be: not even its status was rewritten.
    assert kube.isvc(k8s_namespace, "before")["metadata"]["resourceVersion"] == settled
    assert second.stop() == 0  # and hands the Lease back for the next test


def test_a_stopping_leader_hands_over_at_once(
    operator_factory: OperatorFactory,
    kube: Kube,
    k8s_namespace: str,
    k8s_api: ApiClient,
    ladle_chart: str,
) -> None:
    leader = operator_factory("handover-first")
    leader.wait_leading()
    standby = operator_factory("handover-second")
    wait_for(lambda: standby.get("/readyz")[0] == 200, "the standby to be ready")

    assert leader.stop(signal.SIGTERM) == 0
    stopped = time.monotonic()
    standby.wait_leading(timeout=10)
    print(f"\nhandover after SIGTERM took {time.monotonic() - stopped:.1f}s")
    assert holder(k8s_api, ladle_chart) == "handover-second"
    kube.apply(isvc("handed-over"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "handed-over", "Ready")
    assert standby.stop() == 0


def test_operator_recovers_from_an_apiserver_restart(
    operator_factory: OperatorFactory, kube: Kube, k8s_cluster: KubeCluster, k8s_namespace: str
) -> None:
    op = operator_factory("restart")
    op.wait_leading()
    kube.apply(isvc("before"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "before", "Ready")

    down = k8s_cluster.cluster.restart_apiserver()
    print(f"\nkube-apiserver was back after {down:.1f}s")

    # The same process (it never exits) leads again, its watches resumed: a new object and an
    # edit of an old one are both reconciled.
    op.wait_leading(timeout=60)
    kube.apply(isvc("after"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "after", "Ready", timeout=90)
    scaled = kube.kubectl("scale", "-n", k8s_namespace, "lisvc/before", "--replicas=2")
    assert scaled.returncode == 0, scaled.stderr
    wait_for(
        lambda: (
            kube.apps.read_namespaced_deployment("before-stable", k8s_namespace).spec.replicas == 2
        ),
        "the edit after the restart to reach the Deployment",
        timeout=60,
    )
    assert op.proc.poll() is None
    assert op.stop() == 0
