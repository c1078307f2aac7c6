"""Scheduling against ``nvidia.com/gpu`` on kwok's fake GPU nodes, with the real scheduler."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from ladle_dev.cluster.nodes import GPU_RESOURCE
from ladle_dev.pytest_plugin import wait_until

pytestmark = pytest.mark.cluster

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


def _gpu_pod_spec(gpus: int) -> client.V1PodSpec:
    # Extended resources are set as limits; the API server copies them into requests.
    return client.V1PodSpec(
        node_selector={GPU_PRODUCT_LABEL: "NVIDIA-H200"},
        containers=[
            client.V1Container(
                name="engine",
                image="ladle/engine:test",
                resources=client.V1ResourceRequirements(limits={GPU_RESOURCE: str(gpus)}),
            )
        ],
    )


def test_nodes_advertise_gpus_and_product_labels(k8s_api: ApiClient) -> None:
    node_list = client.CoreV1Api(k8s_api).list_node(label_selector="type=kwok").items
    assert len(node_list) == 2
    for node in node_list:
        assert node.metadata.labels[GPU_PRODUCT_LABEL] == "NVIDIA-H200"
        assert node.metadata.labels["nvidia.com/gpu.count"] == "8"
        assert node.status.capacity[GPU_RESOURCE] == "8"
        assert node.status.allocatable[GPU_RESOURCE] == "8"


def test_nodes_renew_their_leases_like_kubelets(k8s_api: ApiClient) -> None:
    # Without Leases, node-lifecycle marks every node and its pods NotReady for a few seconds in
    # each grace period, and Ready pods flicker under the tests' feet.
    coordination = client.CoordinationV1Api(k8s_api)
    names = [
        n.metadata.name
        for n in client.CoreV1Api(k8s_api).list_node(label_selector="type=kwok").items
    ]
    first = {
        name: coordination.read_namespaced_lease(name, "kube-node-lease").spec.renew_time
        for name in names
    }
    wait_until(
        lambda: all(
            coordination.read_namespaced_lease(name, "kube-node-lease").spec.renew_time
            > first[name]
            for name in names
        ),
        "every node Lease to be renewed",
        timeout=60,
    )


def test_gpu_deployment_gets_running_ready_pods(k8s_api: ApiClient, k8s_namespace: str) -> None:
    labels = {"app": "gpu-engine"}
    deployment = client.V1Deployment(
        metadata=client.V1ObjectMeta(name="gpu-engine"),
        spec=client.V1DeploymentSpec(
            replicas=3,
            selector=client.V1LabelSelector(match_labels=labels),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels=labels), spec=_gpu_pod_spec(1)
            ),
        ),
    )
    apps = client.AppsV1Api(k8s_api)
    apps.create_namespaced_deployment(k8s_namespace, deployment)

    def ready_replicas() -> bool:
        status = apps.read_namespaced_deployment_status("gpu-engine", k8s_namespace).status
        return status.ready_replicas == 3

    wait_until(ready_replicas, "3 ready replicas of a Deployment asking for 1 GPU each")
    pods = client.CoreV1Api(k8s_api).list_namespaced_pod(
        k8s_namespace, label_selector="app=gpu-engine"
    )
    gpu_nodes = {
        node.metadata.name
        for node in client.CoreV1Api(k8s_api).list_node(label_selector=GPU_PRODUCT_LABEL).items
    }
    assert len(pods.items) == 3
    for pod in pods.items:
        assert pod.status.phase == "Running"
        ready = {c.type: c.status for c in pod.status.conditions}["Ready"]
        assert ready == "True"
        assert pod.spec.node_name in gpu_nodes
        assert pod.spec.containers[0].resources.requests[GPU_RESOURCE] == "1"


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(
    k8s_api: ApiClient, k8s_namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="too-big"), spec=_gpu_pod_spec(9))
    core.create_namespaced_pod(k8s_namespace, pod)

    def unschedulable() -> Any:
        status = core.read_namespaced_pod_status("too-big", k8s_namespace).status
        for condition in status.conditions or []:
            if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                return status, condition
        return None

    status, condition = wait_until(unschedulable, "the scheduler to mark the pod Unschedulable")
    assert status.phase == "Pending"
    assert condition.status == "False"
    assert f"Insufficient {GPU_RESOURCE}" in condition.message
