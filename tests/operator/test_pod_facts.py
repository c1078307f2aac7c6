"""What runtime pods really do, as a kubelet reports it: why a container cannot start or keeps
dying, and the GPUs a pod holds until it is gone.

kwok would report every pod Running at once, so most pods here land on a node kwok leaves
alone, and the test writes their status the way the kubelet does. Two tests run their pods
for real on a local node (a real kubelet): a missing Secret volume, a failure found only in
the pod's Events, which a test playing the kubelet would have to invent; and a KV cache larger
than the memory limit, which the kernel's OOM killer ends.
"""

from __future__ import annotations

import time

import pytest
from kube_harness import (
    Kube,
    OperatorProcess,
    finish_terminating_pods,
    isvc_manifest,
    kubelet_status,
    manual_pool_manifest,
    play_kubelet,
    pods_of,
    wait_until,
)
from kubernetes import client

from ladle.operator.config import DEFAULT_RUNTIME_IMAGE

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("operator")]

RUNNING = kubelet_status("Running", ready=True)


def scheduled(kube: Kube, namespace: str, name: str, count: int = 1) -> list[str]:
    return wait_until(
        lambda: (
            (
                names := [
                    p.metadata.name
                    for p in pods_of(kube, namespace, name)
                    if p.spec.node_name and not p.metadata.deletion_timestamp
                ]
            )
            and len(names) == count
            and names
        ),
        f"{count} pods of {name} to be scheduled",
    )


def test_a_container_config_error_reads_as_the_kubelet_reports_it(
    kube: Kube, k8s_namespace: str, manual_node: str
) -> None:
    """A container waiting with a reason of its own (here CreateContainerConfigError, as for a
    Secret read as environment) reaches the conditions in the kubelet's words. The API key
    Secret is mounted as a volume, which a real kubelet reports as FailedMount instead: the
    next test runs that for real."""
    pool = f"{k8s_namespace}-node"
    kube.apply(manual_pool_manifest(pool, manual_node))
    try:
        kube.apply(
            isvc_manifest("chat", gpuPool=pool, apiKeySecret={"name": "chat-key"}), k8s_namespace
        )
        scheduled(kube, k8s_namespace, "chat")
        why = 'secret "chat-key" not found'
        play_kubelet(
            kube,
            k8s_namespace,
            "chat",
            kubelet_status("Pending", ready=False, waiting=("CreateContainerConfigError", why)),
        )
        obj = kube.wait_condition(
            k8s_namespace, "chat", "Ready", "False", "CreateContainerConfigError"
        )
        ready = kube.condition(obj, "Ready")["message"]
        assert ready == (
            "1 pod of Deployment chat-stable cannot start: CreateContainerConfigError: " + why
        )
        assert kube.condition(obj, "Stalled")["status"] == "True"
        assert kube.condition(obj, "Degraded")["reason"] == "CreateContainerConfigError"
        row = kube.kubectl("get", "-n", k8s_namespace, "lisvc", "chat", "--no-headers").stdout
        assert row.split()[4:7] == ["False", "True", "CreateContainerConfigError"]

        # The Secret appears; the kubelet starts the container.
        play_kubelet(kube, k8s_namespace, "chat", RUNNING)
        obj = kube.wait_condition(k8s_namespace, "chat", "Ready", reason="Available")
        assert kube.condition(obj, "Degraded")["status"] == "False"
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")


def test_a_missing_api_key_secret_volume_reads_as_the_pods_own_failed_mount(
    kube: Kube, local_namespace: str
) -> None:
    """A real pod on a local node: the Secret volume cannot be mounted, so its container waits
    in ContainerCreating and only a FailedMount Event says why. The operator reads it within
    seconds, and creating the Secret lets the pod start and clears it."""
    ns = local_namespace
    kube.apply(
        isvc_manifest(
            "nokey",
            runtime={"image": DEFAULT_RUNTIME_IMAGE},  # the image the local nodes hold
            resources={"gpus": 0, "cpu": "250m"},
            engine={"kvCacheMemory": "256Mi"},
            apiKeySecret={"name": "nokey-key"},
        ),
        ns,
    )
    (pod,) = scheduled(kube, ns, "nokey")
    started = time.monotonic()
    obj = kube.wait_condition(ns, "nokey", "Degraded", "True", "FailedMount", timeout=30)
    print(f"FailedMount surfaced {time.monotonic() - started:.1f}s after scheduling")
    # The kubelet may post the Event before it first reports the pod's containers.
    containers = wait_until(
        lambda: kube.core.read_namespaced_pod(pod, ns).status.container_statuses,
        "the kubelet to report the pod's containers",
        timeout=30,
    )
    waiting = containers[0].state.waiting
    assert waiting.reason == "ContainerCreating"  # the pod's status says no more than that
    kubelet = next(m for t, r, m in kube.events(ns, pod) if (t, r) == ("Warning", "FailedMount"))
    assert 'secret "nokey-key" not found' in kubelet
    why = f"1 pod of Deployment nokey-stable cannot start: FailedMount: {kubelet}"
    assert kube.condition(obj, "Degraded")["message"] == why
    assert (kube.condition(obj, "Ready")["status"], kube.condition(obj, "Ready")["reason"]) == (
        "False",
        "FailedMount",
    )
    assert kube.condition(obj, "Stalled")["status"] == "True"  # someone must create it
    row = kube.kubectl("get", "-n", ns, "lisvc", "nokey", "--no-headers").stdout
    assert row.split()[4:7] == ["False", "True", "FailedMount"]
    wait_until(
        lambda: ("Warning", "FailedMount", why) in kube.events(ns, "nokey"),
        "a FailedMount Event on the InferenceService",
        timeout=15,
    )

    # The Secret appears: the kubelet mounts it on its next try and the runtime starts.
    kube.core.create_namespaced_secret(
        ns,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="nokey-key"), string_data={"api-key": "k"}
        ),
    )
    obj = kube.wait_condition(ns, "nokey", "Ready", reason="Available", timeout=180)
    assert kube.condition(obj, "Degraded")["status"] == "False"
    assert kube.condition(obj, "Stalled")["status"] == "False"
    wait_until(
        lambda: ("Normal", "Recovered", "No longer degraded") in kube.events(ns, "nokey"),
        "a Recovered Event",
        timeout=15,
    )
    kube.kubectl("delete", "-n", ns, "lisvc", "nokey", "--wait=false")


def test_a_kv_cache_over_the_memory_limit_reads_as_oom_killed(
    kube: Kube, local_namespace: str
) -> None:
    """A real pod whose engine asks for a 1 GiB KV cache inside a 768 MiB limit: the kernel
    kills it at start, every time, and the service says so by name, with the limit and what
    to change, while the kubelet backs off from restarting it."""
    ns = local_namespace
    kube.apply(
        isvc_manifest(
            "greedy",
            runtime={"image": DEFAULT_RUNTIME_IMAGE},
            resources={"gpus": 0, "cpu": "250m", "memory": "768Mi"},
            engine={"kvCacheMemory": "1Gi"},
        ),
        ns,
    )
    (pod,) = scheduled(kube, ns, "greedy")
    obj = kube.wait_condition(ns, "greedy", "Degraded", "True", "OOMKilled", timeout=180)
    runtime = kube.core.read_namespaced_pod(pod, ns).status.container_statuses[0]
    killed = runtime.state.terminated or runtime.last_state.terminated
    assert (killed.reason, killed.exit_code) == ("OOMKilled", 137)  # the kernel's, via cgroups
    message = kube.condition(obj, "Degraded")["message"]
    assert message.startswith(
        "1 pod of Deployment greedy-stable cannot start: OOMKilled: container runtime was "
        "killed by the kernel for exceeding its memory limit (768Mi), "
    )
    assert message.endswith(
        "raise resources.memory, or lower engine.kvCacheMemory or engine.maxNumSeqs"
    )
    ready = kube.condition(obj, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "OOMKilled")
    assert kube.condition(obj, "Stalled")["status"] == "True"  # only a spec change ends it
    kube.kubectl("delete", "-n", ns, "lisvc", "greedy", "--wait=false")


def test_a_draining_pod_keeps_its_gpu_until_it_is_gone(
    kube: Kube, k8s_namespace: str, manual_node: str, operator: OperatorProcess
) -> None:
    pool = f"{k8s_namespace}-drain"
    kube.apply(manual_pool_manifest(pool, manual_node, quota={"gpus": 1}))
    try:
        kube.apply(isvc_manifest("old", gpuPool=pool), k8s_namespace)
        scheduled(kube, k8s_namespace, "old")
        play_kubelet(kube, k8s_namespace, "old", RUNNING)
        kube.wait_condition(k8s_namespace, "old", "Ready", reason="Available")

        # "old" is deleted; its pod drains (no kubelet ends it), still holding the GPU.
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "old", "--wait=false")
        wait_until(
            lambda: all(p.metadata.deletion_timestamp for p in pods_of(kube, k8s_namespace, "old")),
            "the old pod to be terminating",
        )
        kube.apply(isvc_manifest("new", gpuPool=pool), k8s_namespace)
        obj = kube.wait_condition(k8s_namespace, "new", "Ready", "False", "QuotaExceeded")
        assert "allows 0 of 1 replica" in kube.condition(obj, "Degraded")["message"]
        status = wait_until(
            lambda: (s := kube.pool(pool).get("status") or {}).get("held") == 1 and s,
            "the pool to count the draining pod",
        )
        assert status["claimed"] == 1
        # And it stays so while the pod drains, however often the operator looks.
        operator.reconcile_after(
            lambda: kube.kubectl(
                "annotate", "lisvc", "new", "test.ladle.dev/poke=1", "-n", k8s_namespace
            )
        )
        assert kube.apps.read_namespaced_deployment("new-stable", k8s_namespace).spec.replicas == 0

        # The kubelet reports the old container gone: its GPU passes on.
        assert finish_terminating_pods(kube, k8s_namespace, "old") == 1
        scheduled(kube, k8s_namespace, "new")
        play_kubelet(kube, k8s_namespace, "new", RUNNING)
        kube.wait_condition(k8s_namespace, "new", "Ready", reason="Available")
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")
        for name in ("old", "new"):
            finish_terminating_pods(kube, k8s_namespace, name)
