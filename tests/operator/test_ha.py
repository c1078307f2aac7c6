"""High availability: one Lease, one actor at a time whatever the network does, failover in
time, and watch gaps that lose nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from kube_harness import (
    Kube,
    OperatorFactory,
    Relay,
    compact_etcd,
    isvc_manifest,
    pool_manifest,
    wait_until,
    with_server,
)
from kubernetes import client
from kubernetes.client import ApiClient

from ladle_dev.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster

FAILOVER_TARGET_SECONDS = 30
# A shorter lease for the two-leader tests: the same ratios as the defaults (15/10/2), so the
# same races, in less time.
QUICK_ELECTION = ["--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1"]


def isvc(name: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "ladle.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": {"model": {"name": "smollm2"}},
        }
    )


def lease(api: ApiClient, namespace: str) -> tuple[str, int]:
    """(holder, transitions) of the operator's Lease."""
    spec = client.CoordinationV1Api(api).read_namespaced_lease("ladle-operator", namespace).spec
    return str(spec.holder_identity or ""), int(spec.lease_transitions or 0)


@pytest.fixture
def relay(k8s_cluster: KubeCluster, tmp_path: Path) -> Iterator[Relay]:
    proxy = Relay(k8s_cluster.server, k8s_cluster.cluster.pki_dir, tmp_path)
    yield proxy
    proxy.heal()
    proxy.close()


def test_killing_the_active_operator_fails_over_without_rewriting_anything(
    operator_factory: OperatorFactory,
    kube: Kube,
    k8s_namespace: str,
    k8s_api: ApiClient,
    ladle_chart: str,
) -> None:
    first = operator_factory("ha-first")
    first.wait_leading()
    second = operator_factory("ha-second")
    pool = f"{k8s_namespace}-none"
    try:
        wait_until(lambda: second.get("/readyz")[0] == 200, "the standby to be ready")

        # One healthy service, and one that is Degraded because of its pods: the new leader must
        # know those pods before it speaks, or it would call the service recovered.
        kube.apply(pool_manifest(pool, nodeSelector={}, resourceName="example.com/missing-gpu"))
        kube.apply(isvc("before"), k8s_namespace)
        kube.apply(isvc_manifest("stuck", gpuPool=pool), k8s_namespace)
        kube.wait_condition(k8s_namespace, "before", "Ready")
        kube.wait_condition(k8s_namespace, "stuck", "Degraded", reason="InsufficientGPUs")
        # The pool's status settles too: a reconcile of it ends after a change of no consequence.
        first.reconcile_after(
            lambda: kube.kubectl("annotate", "gpupool", pool, "test.ladle.dev/poke=1"), kind="pool"
        )
        kube.wait_event(k8s_namespace, "stuck", "Warning", "InsufficientGPUs")  # posted after
        # Meanwhile the standby stayed passive, through all of the leader's work: no
        # leadership, no reconciles.
        assert second.metric("ladle_operator_leader") == 0.0
        assert not second.metric("ladle_operator_reconcile_total")
        assert lease(k8s_api, ladle_chart)[0] == "ha-first"
        settled = {
            name: kube.isvc(k8s_namespace, name)["metadata"]["resourceVersion"]
            for name in ("before", "stuck")
        }
        events = len(kube.events(k8s_namespace, "stuck"))

        first.stop(signal.SIGKILL)  # no chance to release the Lease
        killed = time.monotonic()
        second.wait_leading(timeout=FAILOVER_TARGET_SECONDS)
        failover = time.monotonic() - killed
        print(f"\nfailover after SIGKILL took {failover:.1f}s")
        assert failover < FAILOVER_TARGET_SECONDS
        assert lease(k8s_api, ladle_chart)[0] == "ha-second"

        kube.apply(isvc("after"), k8s_namespace)
        kube.wait_condition(k8s_namespace, "after", "Ready")
        assert second.metric("ladle_operator_reconcile_total", kind="isvc", result="ok")
        # The new leader found both exactly as they should be: not even their status rewritten.
        for name, version in settled.items():
            assert kube.isvc(k8s_namespace, name)["metadata"]["resourceVersion"] == version, name
        assert len(kube.events(k8s_namespace, "stuck")) == events
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")
        stopped = second.stop()  # and hands the Lease back for the next test
    # Not in `finally`, where a failed assert would hide the error that got there.
    assert stopped == 0


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
    wait_until(lambda: standby.get("/readyz")[0] == 200, "the standby to be ready")

    assert leader.stop(signal.SIGTERM) == 0
    stopped = time.monotonic()
    standby.wait_leading(timeout=10)
    print(f"\nhandover after SIGTERM took {time.monotonic() - stopped:.1f}s")
    assert lease(k8s_api, ladle_chart)[0] == "handover-second"
    kube.apply(isvc("handed-over"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "handed-over", "Ready")
    assert standby.stop() == 0


def lease_requests(method: str, path: str) -> bool:
    return "/leases/" in path or path.endswith("/leases")


def everything(method: str, path: str) -> bool:
    return True


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["lease-requests", "partition", "sigstop"])
def test_the_old_leader_writes_nothing_once_a_new_one_holds_the_lease(
    fault: str,
    operator_factory: OperatorFactory,
    operator_kubeconfig: Path,
    relay: Relay,
    kube: Kube,
    k8s_namespace: str,
    k8s_api: ApiClient,
    ladle_chart: str,
    tmp_path: Path,
) -> None:
    """The leader reaches the API server through a relay. Its Lease requests alone hang (one
    stuck connection, a slow Lease write), or everything does, or the process freezes; new
    InferenceServices keep arriving, so a leader that thinks it still leads has work to do.
    Once the standby holds the Lease, the relay must see no write from the old leader."""
    via_relay = with_server(operator_kubeconfig, relay.url, tmp_path / "relay.kubeconfig")
    old = operator_factory(f"old-{fault}", kubeconfig=via_relay, extra_args=QUICK_ELECTION)
    old.wait_leading()
    new = operator_factory(f"new-{fault}", extra_args=QUICK_ELECTION)
    try:
        wait_until(lambda: new.get("/readyz")[0] == 200, "the standby to be ready")
        _, transitions = lease(k8s_api, ladle_chart)
        kube.apply(isvc("warm-up"), k8s_namespace)
        kube.wait_condition(k8s_namespace, "warm-up", "Ready")

        stop = threading.Event()
        created: list[str] = []

        def keep_creating() -> None:
            while not stop.wait(1.0):
                name = f"svc-{len(created)}"  # on CPU: no GPU runs out however long it takes
                kube.apply(isvc_manifest(name, resources={"gpus": 0}), k8s_namespace)
                created.append(name)

        if fault == "sigstop":
            os.kill(old.pid, signal.SIGSTOP)
        else:
            relay.stall(lease_requests if fault == "lease-requests" else everything,
                        streams=fault == "partition")  # fmt: skip
        creator = threading.Thread(target=keep_creating, daemon=True)
        creator.start()
        try:
            wait_until(
                lambda: lease(k8s_api, ladle_chart) == (f"new-{fault}", transitions + 1),
                "the standby to take the Lease",
                timeout=45,
            )
            taken = time.monotonic()
            new.wait_leading(timeout=15)
            # Work arrives that the old leader, unfenced, would take up: the new one does it.
            first = len(created)
            wait_until(lambda: len(created) >= first + 2, "two services after the handover")
            for name in created[first : first + 2]:
                kube.wait_condition(k8s_namespace, name, "Ready", timeout=60)
        finally:
            if fault == "sigstop":
                os.kill(old.pid, signal.SIGCONT)
            relay.heal()
        # Whatever the old leader still had in flight arrives, and it says it stands by.
        wait_until(
            lambda: relay.held == 0 and old.metric("ladle_operator_leader") == 0.0,
            "the old leader to stand by with nothing held",
            timeout=20,
        )
        stop.set()
        creator.join()

        late = relay.writes_after(taken)
        assert late == [], f"the old leader wrote after {fault}: {late[:5]}"
        for name in created[-2:]:  # the new leader reconciles what arrived meanwhile
            kube.wait_condition(k8s_namespace, name, "Ready", timeout=60)
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        # Both go, whatever happened: the next test needs the Lease free.
        stopped = (new.stop(), old.stop())
    assert stopped == (0, 0)


def gap_scenario(
    kube: Kube, namespace: str, pool: str
) -> tuple[Callable[[], None], Callable[[], None]]:
    """Two services in a quota pool. Returns (what to do during the gap, what to check after):
    during it, a child Service of one and the whole other service are deleted."""
    kube.apply(pool_manifest(pool, quota={"gpus": 4}))
    kube.apply(isvc_manifest("keep", gpuPool=pool), namespace)
    kube.apply(isvc_manifest("drop", gpuPool=pool, replicas=2), namespace)
    kube.wait_condition(namespace, "keep", "Ready")
    kube.wait_condition(namespace, "drop", "Ready")
    wait_until(lambda: kube.pool(pool).get("status", {}).get("claimed") == 3, "3 GPUs claimed")
    uid = kube.core.read_namespaced_service("keep", namespace).metadata.uid

    def during() -> None:
        assert kube.kubectl("delete", "-n", namespace, "service/keep").returncode == 0
        assert kube.kubectl("delete", "-n", namespace, "lisvc/drop").returncode == 0
        wait_until(
            lambda: (
                not kube.core.list_namespaced_pod(
                    namespace, label_selector="ladle.dev/inferenceservice=drop"
                ).items
            ),
            "the deleted service's pods to go",
        )

    def after() -> None:
        wait_until(
            lambda: kube.core.read_namespaced_service("keep", namespace).metadata.uid != uid,
            "the deleted Service to be recreated",
            timeout=60,
        )
        wait_until(
            lambda: (
                (s := kube.pool(pool).get("status") or {}).get("inferenceServices") == 1
                and s.get("claimed") == 1
            ),
            "the deleted service's quota to be released",
            timeout=60,
        )
        kube.wait_condition(namespace, "keep", "Ready")

    return during, after


@pytest.mark.slow
@pytest.mark.parametrize("deleted", ["before-the-restart", "after-the-restart"])
def test_a_watch_gap_across_an_api_server_restart_loses_nothing(
    deleted: str,
    operator_factory: OperatorFactory,
    kube: Kube,
    k8s_cluster: KubeCluster,
    k8s_namespace: str,
) -> None:
    """The operator is frozen; the API server restarts; a child Service and a whole
    InferenceService are deleted; etcd is compacted. After the thaw nothing is stale.

    Deleted before the restart, the watch events reach the frozen process anyway (they wait in
    its sockets) and the old code coped; deleted after it, only a re-list can tell."""
    op = operator_factory(f"gap-{deleted}")
    op.wait_leading()
    pool = f"{k8s_namespace}-gap"
    try:
        during, after = gap_scenario(kube, k8s_namespace, pool)
        os.kill(op.pid, signal.SIGSTOP)
        try:
            if deleted == "before-the-restart":
                during()
            down = k8s_cluster.cluster.restart_apiserver()
            print(f"\nkube-apiserver was back after {down:.1f}s")
            if deleted == "after-the-restart":
                during()
            compact_etcd(k8s_cluster.cluster.state()["ports"]["etcd"])
        finally:
            os.kill(op.pid, signal.SIGCONT)
        after()

        # The same process (it never exits) leads again, its watches resumed: a new object and an
        # edit of an old one are both reconciled.
        op.wait_leading(timeout=60)
        kube.apply(isvc("after"), k8s_namespace)
        kube.wait_condition(k8s_namespace, "after", "Ready", timeout=90)
        scaled = kube.kubectl("scale", "-n", k8s_namespace, "lisvc/keep", "--replicas=2")
        assert scaled.returncode == 0, scaled.stderr
        wait_until(
            lambda: (
                kube.apps.read_namespaced_deployment("keep-stable", k8s_namespace).spec.replicas
                == 2
            ),
            "the edit after the restart to reach the Deployment",
            timeout=60,
        )
        assert op.proc.poll() is None
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")
    assert op.stop() == 0


def test_a_relist_after_410_gone_evicts_what_vanished(
    operator_factory: OperatorFactory,
    operator_kubeconfig: Path,
    relay: Relay,
    kube: Kube,
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    """The same gap without a new leadership term to hide it (no leader election): the relay
    holds everything back, then answers the operator's watches with 410 Gone. kopf re-lists,
    which reports what exists but never what was deleted meanwhile; the operator's store must
    notice by itself."""
    via_relay = with_server(operator_kubeconfig, relay.url, tmp_path / "relay.kubeconfig")
    op = operator_factory("relist", kubeconfig=via_relay, extra_args=["--no-leader-elect"])
    op.wait_leading()
    pool = f"{k8s_namespace}-relist"
    try:
        during, after = gap_scenario(kube, k8s_namespace, pool)
        relay.stall(everything, streams=True)
        try:
            during()
        finally:
            relay.expire_watches()
            relay.heal()
        after()
        assert "evicted objects a re-list no longer holds" in op.log.read_text()
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", pool, "--wait=false")
    assert op.stop() == 0
