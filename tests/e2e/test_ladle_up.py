"""``ladle up`` then ``ladle down``, as a newcomer runs them: a second, whole cluster with the
operator as pods and a serving runtime pod, and afterwards nothing of it left running.

It runs before this package's other modules (file order), while no other runtime pod loads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from ladle.cluster import build
from ladle.cluster.control_plane import used_loopback_subnets

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
    """Everything this cluster runs: components name the state folder on their command line,
    containers carry the cluster's marker in their environment."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if any(str(state_dir) in arg for arg in proc.cmdline()) or (
                proc.environ().get("LADLE_NODE_AGENT_CLUSTER") == cluster_id
            ):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def listening(ports: set[int], subnet: int) -> list[tuple[str, int]]:
    """Listening sockets on the cluster's component ports or on its loopback subnet."""
    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr:
            continue
        ip, port = conn.laddr.ip, conn.laddr.port
        if port in ports or ip.startswith(f"127.{subnet}."):
            found.append((ip, port))
    return found


def test_ladle_up_serves_and_ladle_down_leaves_nothing_running(tmp_path: Path) -> None:
    state_dir = (tmp_path / "system").resolve()
    up = ladle("up", "--state-dir", str(state_dir), "--wait", "300")
    state = json.loads((state_dir / "state.json").read_text()) if state_dir.exists() else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        for step in range(1, 7):
            assert f"[{step}/6]" in up.stdout
        match = re.search(r"OpenAI base URL: (http://127\.(\d+)\.\d+\.\d+:\d+/v1)", up.stdout)
        assert match, up.stdout
        subnet = int(match.group(2))
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
        # etcd, kube-apiserver, -controller-manager, -scheduler, the agent, two operator
        # pods and the runtime pod
        assert len(running) >= 8, [p.cmdline()[:2] for p in running]
        ports = set(state["ports"].values())
        assert subnet in used_loopback_subnets()
        assert listening(ports, subnet)
    finally:
        down = ladle("down", "--state-dir", str(state_dir), timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not state_dir.exists()
    assert cluster_processes(state_dir, state["cluster_id"]) == []
    assert listening(set(state["ports"].values()), subnet) == []
