"""What one node agent is told at start: its API credentials and the nodes it runs.

``ladle.cluster.control_plane`` writes this as ``agent.json`` in the cluster's state folder;
the agent reads it back (``python -m ladle.cluster.agent CONFIG``). Plain data, no I/O beyond
the JSON file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KUBELET_PORT = 10250
# Set on every container process: how `down` and a restarted agent find what an agent started.
CLUSTER_ENV = "LADLE_NODE_AGENT_CLUSTER"


@dataclass(frozen=True)
class NodeConfig:
    """One local Node: its address, its pod range and what it advertises."""

    name: str
    ip: str
    pod_cidr: str
    cpu: str
    memory_bytes: int
    gpus: int
    gpu_product: str
    gpu_memory_mib: int
    pods: int = 110
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class AgentConfig:
    cluster_id: str
    server: str
    ca_file: str
    cert_file: str
    key_file: str
    serving_cert_file: str
    serving_key_file: str
    # Client certificates signed by this CA may read logs (kube-apiserver's kubelet client).
    client_ca_file: str
    state_dir: str
    nodes: list[NodeConfig]
    kubelet_port: int = KUBELET_PORT

    @property
    def api_host(self) -> str:
        return self.server.removeprefix("https://").rsplit(":", 1)[0]

    @property
    def api_port(self) -> int:
        return int(self.server.rsplit(":", 1)[1])

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> AgentConfig:
        data: dict[str, Any] = json.loads(path.read_text())
        data["nodes"] = [NodeConfig(**node) for node in data["nodes"]]
        return cls(**data)
