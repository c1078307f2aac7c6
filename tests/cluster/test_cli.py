"""``ladle cluster up|status|down`` as a user runs them, next to the session's cluster (a second
cluster with kwok's nodes only: ``tests/e2e/test_ladle_up.py`` brings up and down one with a
local node beside the session's)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ladle_dev.pytest_plugin import KubeCluster

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
    k8s_cluster: KubeCluster, tmp_path: Path
) -> None:
    state_dir = tmp_path / "second"
    up = _ladle(
        "up", "--state-dir", str(state_dir), "--nodes", "1", "--gpus-per-node", "4",
        "--local-nodes", "0",
    )  # fmt: skip
    assert up.returncode == 0, up.stdout + up.stderr
    assert re.search(r"cluster Ready in \d+\.\ds", up.stdout), up.stdout
    assert ", 1 kwok GPU node, 0 local nodes\n" in up.stdout, up.stdout  # never "1 kwok GPU nodes"
    kubeconfig = state_dir / "admin.kubeconfig"
    assert f"kubeconfig: {kubeconfig.resolve()}" in up.stdout

    try:
        status = _ladle("status", "--state-dir", str(state_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["readyz"] == "ok"
        assert report["nodes"] == {"ladle-gpu-0": "True"}
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
        assert sorted(state["processes"]) == [
            "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
        ]  # fmt: skip
        assert state["network"] is None  # no local nodes: the API server stays on loopback
        assert report["server"].startswith("https://127.0.0.1:")
    finally:
        down = _ladle("down", "--state-dir", str(state_dir))

    assert down.returncode == 0, down.stdout + down.stderr
    assert not state_dir.exists()
    assert not any(_alive(pid) for pid in pids)
    # `down` went by recorded pids, not by name: the session's identical binaries still serve.
    nodes = k8s_cluster.run_kubectl("get", "nodes", "-o", "name")
    assert nodes.returncode == 0, nodes.stderr
    assert "node/ladle-gpu-1" in nodes.stdout
    assert all(k8s_cluster.cluster.running().values())
