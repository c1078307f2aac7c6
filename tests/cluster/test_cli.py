"""``ladle cluster up|status|down`` as a user runs them, next to the session's cluster: the
second cluster's local node comes up beside the session's, and ``down`` leaves nothing of it
behind (no process, network namespace, link, mount or cgroup) and nothing of the session's
touched."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ladle.cluster import cgroups, network
from ladle.cluster.node import RUN_ROOT, LocalNode, mount_points_under
from ladle.cluster.pytest_plugin import KubeCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ladle(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ladle.cli", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_up_status_down_leaves_other_clusters_alone(
    k8s_cluster: KubeCluster, k8s_local_nodes: list[LocalNode], tmp_path: Path
) -> None:
    state_dir = tmp_path / "second"
    up = _ladle(
        "up", "--state-dir", str(state_dir), "--nodes", "1", "--gpus-per-node", "4",
        "--local-nodes", "1",
    )  # fmt: skip
    assert up.returncode == 0, up.stdout + up.stderr
    assert re.search(r"cluster Ready in \d+\.\ds", up.stdout), up.stdout
    assert ", 1 kwok GPU node, 1 local node\n" in up.stdout, up.stdout  # never "1 local nodes"
    kubeconfig = state_dir / "admin.kubeconfig"
    assert f"kubeconfig: {kubeconfig.resolve()}" in up.stdout

    try:
        status = _ladle("status", "--state-dir", str(state_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["readyz"] == "ok"
        assert report["nodes"] == {"ladle-gpu-0": "True", "ladle-local-0": "True"}
        # Its own ports: a different API server from the session's cluster.
        assert report["server"] != k8s_cluster.server
        gpus = k8s_cluster.run_kubectl(
            "get",
            "node",
            "ladle-gpu-0",
            "-o",
            r"jsonpath={.status.allocatable.nvidia\.com/gpu}",
            kubeconfig=kubeconfig,
        )
        assert gpus.stdout == "4", gpus.stderr
        state = json.loads((state_dir / "state.json").read_text())
        pids = [int(record["pid"]) for record in state["processes"].values()]
        # etcd, the API server, controller-manager, scheduler, kwok, and the local node's
        # containerd, kubelet, device plugin and the cluster's kube-proxy.
        assert sorted(state["processes"]) == [
            "containerd-ladle-local-0", "etcd", "gpu-plugin-ladle-local-0", "kube-apiserver",
            "kube-controller-manager", "kube-proxy", "kube-scheduler", "kubelet-ladle-local-0",
            "kwok",
        ]  # fmt: skip
        net = network.Plan(state["network"]["block"], state["network"]["name"])
        assert net.block != k8s_cluster.cluster.network_plan().block  # type: ignore[union-attr]
        run_dir = RUN_ROOT / state["cluster_id"]
        assert mount_points_under((run_dir,))  # the node's mount namespace is kept there
        assert cgroups.processes(f"/ladle/{state['cluster_id']}") == set()  # no pods yet
    finally:
        down = _ladle("down", "--state-dir", str(state_dir))

    assert down.returncode == 0, down.stdout + down.stderr
    assert not state_dir.exists()
    assert not any(_alive(pid) for pid in pids)
    assert not net.netns_path.exists()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    assert f" {net.host_link}@" not in links.stdout
    assert not run_dir.exists()
    assert not mount_points_under((state_dir, run_dir))
    assert not any(
        (root / "ladle" / state["cluster_id"]).exists() for root in cgroups.hierarchies()
    )
    # `down` went by recorded pids, not by name: the session's identical binaries still serve.
    nodes = k8s_cluster.run_kubectl("get", "nodes", "-o", "name")
    assert nodes.returncode == 0, nodes.stderr
    assert "node/ladle-gpu-1" in nodes.stdout
    assert "node/ladle-local-1" in nodes.stdout
    assert all(k8s_cluster.cluster.running().values())  # the session's nodes were left alone
