"""``ladle up`` then ``ladle down``, as a newcomer runs them: a second, whole cluster with the
operator and gateway as pods and a serving runtime pod, and afterwards nothing of it left: no
process, container, network namespace, link, mount or cgroup.

It runs before this package's other modules (file order), while no other runtime pod loads,
beside the session's cluster and its local nodes, which its ``down`` must leave running. It asks
for one local node instead of the default two: the machine's disk holds the session's two
nodes and one more copy of the seven-gigabyte runtime image, not two more.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ladle_dev.cluster import build, cgroups, network
from ladle_dev.cluster.node import RUN_ROOT, LocalNode, mount_points_under
from ladle_dev.pytest_plugin import KubeCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def ladle(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ladle.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def cluster_processes(state_dir: Path, cluster_id: str) -> list[psutil.Process]:
    """Everything this cluster runs: components name its state folder on their command line,
    containers live in its cgroups."""
    found = [psutil.Process(pid) for pid in cgroups.processes(f"/ladle/{cluster_id}")]
    for proc in psutil.process_iter(["pid"]):
        try:
            if any(str(state_dir) in arg for arg in proc.cmdline()):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def listening(ports: set[int]) -> list[tuple[str, int]]:
    """Listening sockets on the cluster's component ports."""
    return [
        (conn.laddr.ip, conn.laddr.port)
        for conn in psutil.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port in ports
    ]


def test_ladle_up_serves_and_ladle_down_leaves_nothing_behind(
    k8s_cluster: KubeCluster, k8s_local_nodes: list[LocalNode], tmp_path: Path
) -> None:
    state_dir = (tmp_path / "system").resolve()
    up = ladle("up", "--state-dir", str(state_dir), "--local-nodes", "1", "--wait", "300")
    state = json.loads((state_dir / "state.json").read_text()) if state_dir.exists() else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        for step in range(1, 7):
            assert f"[{step}/6]" in up.stdout
        net = network.Plan(state["network"]["block"], state["network"]["name"])
        match = re.search(r"OpenAI base URL: (http://(10\.\d+)\.\d+\.\d+(?::\d+)?/v1)", up.stdout)
        assert match, up.stdout
        assert match.group(2) == f"10.{net.block}"  # the gateway Service, in the cluster's range
        curl = next(line for line in up.stdout.splitlines() if line.startswith("curl "))
        answer = subprocess.run(
            ["bash", "-c", curl], capture_output=True, text=True, timeout=120, check=False
        )
        assert answer.returncode == 0, answer.stderr
        assert json.loads(answer.stdout)["choices"][0]["message"]["content"]
        # The README's next step: this cluster's own kubectl, first on PATH, shows the service.
        shown = subprocess.run(
            ["bash", "-c", f'eval "$({sys.executable} -m ladle.cli cluster env --state-dir '
             f'{state_dir})" && command -v kubectl && kubectl wait --for=condition=Ready lisvc '
             '--all -A --timeout=60s >/dev/null && kubectl get lisvc -A'],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.splitlines()[0] == str(build.bin_dir() / "kubectl")
        assert re.search(r"smollm2 .* True +False +Available", shown.stdout), shown.stdout

        running = cluster_processes(state_dir, state["cluster_id"])
        names = {proc.name() for proc in running}
        # The control plane, the node's daemons, and in its containers the operator and
        # gateway (Python, from the operator image) and the runtime (ladle serve).
        assert {"etcd", "kube-apiserver", "containerd", "kubelet", "kube-proxy"} <= names
        assert sum(1 for proc in running if "serve" in proc.cmdline()) == 1
        assert listening(set(state["ports"].values()))
        assert net.netns_path.exists()
    finally:
        down = ladle("down", "--state-dir", str(state_dir), timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not state_dir.exists()
    assert cluster_processes(state_dir, state["cluster_id"]) == []
    assert listening(set(state["ports"].values())) == []
    assert not net.netns_path.exists()
    assert not (RUN_ROOT / state["cluster_id"]).exists()
    assert not mount_points_under((state_dir, RUN_ROOT / state["cluster_id"]))
    assert not any(
        (root / "ladle" / state["cluster_id"]).exists() for root in cgroups.hierarchies()
    )
    # Nothing of the session's cluster was touched: its nodes' processes and network are there.
    assert all(k8s_cluster.cluster.running().values())
    session = k8s_cluster.cluster.network_plan()
    assert session is not None
    assert session.netns_path.exists()
    nodes = k8s_cluster.run_kubectl("get", "nodes", "-l", "type=local", "--no-headers")
    assert [line.split()[1] for line in nodes.stdout.splitlines()] == ["Ready", "Ready"]
