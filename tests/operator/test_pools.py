"""GPUPools against the real cluster: fair quota, surge within headroom, who may use a pool,
overlaps, and protection from deletion while in use. kwok runs the pods."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kube_harness import Kube, gone, isvc_manifest, pool_manifest, wait_until
from kubernetes import watch

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("operator")]


def replicas(kube: Kube, namespace: str, name: str) -> int:
    return int(kube.apps.read_namespaced_deployment(f"{name}-stable", namespace).spec.replicas)


def test_a_newcomer_gets_its_guaranteed_replica_from_a_full_pool(
    kube: Kube, k8s_namespace: str
) -> None:
    pool = f"{k8s_namespace}-fair"
    kube.apply(pool_manifest(pool, quota={"gpus": 2}))
    try:
        kube.apply(isvc_manifest("first", gpuPool=pool, replicas=2), k8s_namespace)
        kube.wait_condition(k8s_namespace, "first", "Ready", reason="Available")
        # "first" holds the whole quota; "second" is guaranteed one replica all the same.
        kube.apply(isvc_manifest("second", gpuPool=pool), k8s_namespace)
        kube.wait_condition(k8s_namespace, "second", "Ready", reason="Available")
        obj = kube.wait_condition(k8s_namespace, "first", "Ready", reason="QuotaCapped")
        assert kube.condition(obj, "Degraded")["reason"] == "QuotaExceeded"
        assert (
            "quota of 2 GPUs allows 1 of 2 replicas" in kube.condition(obj, "Degraded")["message"]
        )
        assert replicas(kube, k8s_namespace, "first") == 1
        # Capped at a glance: READY True, DEGRADED True, REASON QuotaCapped.
        table = kube.kubectl("get", "-n", k8s_namespace, "lisvc", "first", "--no-headers")
        assert table.stdout.split()[:7] == [
            "first", "smollm2", "2", "1", "True", "True", "QuotaCapped"
        ]  # fmt: skip
        status = wait_until(
            lambda: (s := kube.pool(pool).get("status") or {}).get("requested") == 3 and s,
            "the pool to count 3 requested GPUs",
        )
        assert (status["claimed"], status["inferenceServices"]) == (2, 2)

        # A larger quota goes to the one still waiting.
        kube.apply(pool_manifest(pool, quota={"gpus": 3}))
        kube.wait_condition(k8s_namespace, "first", "Ready", reason="Available")
        assert replicas(kube, k8s_namespace, "first") == 2
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")


@pytest.mark.parametrize(
    "shape",
    [{"resources": {"gpus": 4}}, {"resources": {"gpus": 2}, "parallelism": {"nodes": 2}}],
    ids=["one-pod", "two-node-group"],
)
def test_a_split_replica_that_needs_more_gpus_than_the_quota_waits_named(
    kube: Kube, k8s_namespace: str, shape: dict[str, Any]
) -> None:
    """A replica of 4 GPUs, whether one pod of 4 or a group of two pods of 2: a quota of 2
    cannot hold it, and the service says so instead of starting pods that could never be
    whole."""
    pool = f"{k8s_namespace}-split"
    kube.apply(pool_manifest(pool, quota={"gpus": 2}))
    try:
        kube.apply(isvc_manifest("split", gpuPool=pool, **shape), k8s_namespace)
        obj = kube.wait_condition(k8s_namespace, "split", "Degraded", reason="QuotaExceeded")
        assert (
            "quota of 2 GPUs allows 0 of 1 replica of 4 GPUs each"
            in (kube.condition(obj, "Degraded")["message"])
        )
        assert replicas(kube, k8s_namespace, "split") == 0
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")


class ReplicaSetPeak:
    """The most replicas a Deployment's ReplicaSets asked for at once while watched. This is
    what a rolling update bounds (replicas + maxSurge); live pods may briefly exceed it, since
    the ReplicaSet controller can create a successor before it deletes a predecessor."""

    def __init__(self, kube: Kube, namespace: str, isvc: str) -> None:
        self.kube, self.namespace, self.isvc = kube, namespace, isvc
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        asked: dict[str, int] = {}
        stream = watch.Watch()
        for event in stream.stream(
            self.kube.apps.list_namespaced_replica_set,
            self.namespace,
            label_selector=f"ladle.dev/inferenceservice={self.isvc}",
            timeout_seconds=120,
        ):
            rs = event["object"]
            if event["type"] == "DELETED":
                asked.pop(rs.metadata.name, None)
            else:
                asked[rs.metadata.name] = int(rs.spec.replicas or 0)
            self.most = max(self.most, sum(asked.values()))
            if self._stop.is_set():
                stream.stop()

    def result(self) -> int:
        self._stop.set()
        self.kube.kubectl(  # wake the watch
            "annotate", "-n", self.namespace, "replicaset", "--all", "--overwrite", "poke=1"
        )
        self._thread.join(timeout=30)
        return self.most


def test_a_rollout_surges_only_into_the_pools_headroom(kube: Kube, k8s_namespace: str) -> None:
    """A pool whose quota the service fills has no room for a surge pod: the rollout replaces
    one replica at a time. (Kubernetes starts each replacement as its predecessor begins to
    terminate; the quota plan counts both until the old one is gone.)"""
    pool = f"{k8s_namespace}-tight"
    kube.apply(pool_manifest(pool, quota={"gpus": 2}))
    try:
        kube.apply(isvc_manifest("chat", gpuPool=pool, replicas=2), k8s_namespace)
        kube.wait_condition(k8s_namespace, "chat", "Ready", reason="Available")
        peak = ReplicaSetPeak(kube, k8s_namespace, "chat")
        kube.apply(
            isvc_manifest("chat", gpuPool=pool, replicas=2, engine={"maxModelLen": 1024}),
            k8s_namespace,
        )
        obj = kube.wait_condition(k8s_namespace, "chat", "Progressing", "False", timeout=90)
        assert kube.condition(obj, "Ready")["status"] == "True"
        dep = kube.apps.read_namespaced_deployment("chat-stable", k8s_namespace)
        assert dep.spec.strategy.rolling_update.max_surge == 0  # (kept until the next rollout)
        assert dep.status.updated_replicas == 2
        most = peak.result()
        assert most == 2, f"{most} replicas ran at once in a 2-GPU quota"
        # The last predecessor may still be terminating (claimed, and counted, until it is gone).
        wait_until(
            lambda: kube.pool(pool)["status"]["claimed"] <= 2,
            "the pool's claim back within its 2-GPU quota",
            timeout=30,
        )

        # With room for a spare replica, the next rollout surges (and never drops Ready).
        kube.apply(pool_manifest(pool, quota={"gpus": 3}))
        kube.wait_condition(k8s_namespace, "chat", "Ready", reason="Available")
        peak = ReplicaSetPeak(kube, k8s_namespace, "chat")
        kube.apply(
            isvc_manifest("chat", gpuPool=pool, replicas=2, engine={"maxModelLen": 2048}),
            k8s_namespace,
        )
        wait_until(
            lambda: (
                kube.apps.read_namespaced_deployment(
                    "chat-stable", k8s_namespace
                ).spec.strategy.rolling_update.max_surge
                == 1
            ),
            "the surge strategy",
        )
        kube.wait_condition(k8s_namespace, "chat", "Progressing", "False", timeout=90)
        assert peak.result() == 3
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")


def test_a_pool_admits_only_the_namespaces_it_selects(kube: Kube, k8s_namespace: str) -> None:
    pool = f"{k8s_namespace}-team"
    selector = {"matchLabels": {"ladle.dev/team": "inference"}}
    kube.apply(pool_manifest(pool, namespaceSelector=selector))
    try:
        kube.apply(isvc_manifest("chat", gpuPool=pool), k8s_namespace)
        obj = kube.wait_condition(k8s_namespace, "chat", "Ready", "False", "NamespaceNotAllowed")
        assert kube.condition(obj, "Stalled")["status"] == "True"
        message = kube.condition(obj, "Ready")["message"]
        assert f"namespace {k8s_namespace} may not use GPUPool {pool}" in message
        assert "ladle.dev/team=inference" in message
        assert replicas(kube, k8s_namespace, "chat") == 0

        labelled = kube.kubectl("label", "namespace", k8s_namespace, "ladle.dev/team=inference")
        assert labelled.returncode == 0, labelled.stderr
        kube.wait_condition(k8s_namespace, "chat", "Ready", reason="Available")
        assert replicas(kube, k8s_namespace, "chat") == 1
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")


def test_a_pool_in_use_outlives_its_deletion_and_overlaps_are_reported(
    kube: Kube, k8s_namespace: str
) -> None:
    pool, twin = f"{k8s_namespace}-a", f"{k8s_namespace}-b"
    kube.apply(pool_manifest(pool))
    kube.apply(pool_manifest(twin))
    try:

        def degraded(name: str) -> dict[str, Any] | None:
            cond = kube.condition(kube.pool(name), "Degraded")
            return (
                cond
                if f"with GPUPool {twin if name == pool else pool}" in cond.get("message", "")
                else None
            )

        cond = wait_until(lambda: degraded(pool), "the overlap to be reported")
        # kwok's GPU nodes, and the node agent's when an end-to-end test started it.
        gpu_nodes = kube.core.list_node(label_selector="nvidia.com/gpu.present=true").items
        assert f"shares {len(gpu_nodes)} nodes with GPUPool" in cond["message"]
        wait_until(lambda: degraded(twin), "the overlap to be reported on the twin")

        kube.apply(isvc_manifest("chat", gpuPool=pool), k8s_namespace)
        kube.wait_condition(k8s_namespace, "chat", "Ready")
        wait_until(
            lambda: "ladle.dev/in-use" in (kube.pool(pool)["metadata"].get("finalizers") or ()),
            "the pool to be marked in use",
        )
        deleted = kube.kubectl("delete", "gpupool", pool, "--wait=false")
        assert deleted.returncode == 0, deleted.stderr
        blocked = wait_until(
            lambda: (
                (c := kube.condition(kube.pool(pool), "Degraded")).get("reason")
                == "DeletionBlocked"
                and c
            ),
            "the pool to say what its deletion waits for",
        )
        assert f"{k8s_namespace}/chat" in blocked["message"]
        kube.wait_event("default", pool, "Warning", "DeletionBlocked")
        # Its service keeps running meanwhile.
        assert kube.condition(kube.isvc(k8s_namespace, "chat"), "Ready")["status"] == "True"

        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "chat")
        wait_until(lambda: gone(kube, "gpupool", pool), "the pool to go with its last user")
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, twin, "--wait=false")
