"""Register a local Node and keep it alive as a kubelet does: a Lease renewed every 10 s, and
the Node's status (conditions, capacity, addresses, kubelet endpoint) posted at registration
and every minute."""

from __future__ import annotations

import asyncio
import datetime
import logging
import platform
import shutil
from pathlib import Path
from typing import Any

from ladle import __version__
from ladle.cluster.agent.config import NodeConfig
from ladle.cluster.agent.kube import JSON, TRANSIENT, ApiError, Kube
from ladle.cluster.nodes import GPU_RESOURCE, LOCAL_NODE_LABEL, gfd_labels

log = logging.getLogger("ladle.node_agent")

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40  # what kubelets use
RENEW_SECONDS = 10  # a quarter of the lease, as kubelets renew
STATUS_SECONDS = 60
RUNTIME_VERSION = f"ladle-node-agent://{__version__}"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _read(path: str, default: str = "") -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


def _os_image() -> str:
    for line in _read("/etc/os-release").splitlines():
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return "Linux"


def node_labels(cfg: NodeConfig) -> dict[str, str]:
    return {
        "kubernetes.io/hostname": cfg.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": _arch(),
        "type": "local",
        LOCAL_NODE_LABEL: "true",
        **(gfd_labels(cfg.gpu_product, cfg.gpus, cfg.gpu_memory_mib) if cfg.gpus else {}),
        **cfg.labels,
    }


def capacity(cfg: NodeConfig, disk_bytes: int) -> dict[str, str]:
    resources = {
        "cpu": cfg.cpu,
        "memory": f"{cfg.memory_bytes // 1024}Ki",
        "pods": str(cfg.pods),
        "ephemeral-storage": f"{disk_bytes // 1024}Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
    }
    if cfg.gpus:
        resources[GPU_RESOURCE] = str(cfg.gpus)
    return resources


def conditions(ready: bool, since: str, heartbeat: str) -> list[JSON]:
    def condition(kind: str, status: str, reason: str, message: str) -> JSON:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": heartbeat,
            "lastTransitionTime": since,
        }

    return [
        condition(
            "MemoryPressure",
            "False",
            "KubeletHasSufficientMemory",
            "kubelet has sufficient memory available",
        ),
        condition(
            "DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"
        ),
        condition(
            "PIDPressure",
            "False",
            "KubeletHasSufficientPID",
            "kubelet has sufficient PID available",
        ),
        condition(
            "Ready",
            "True" if ready else "False",
            "KubeletReady" if ready else "KubeletNotReady",
            "kubelet is posting ready status" if ready else "the node agent is starting",
        ),
    ]


def node_status(
    cfg: NodeConfig, *, kubelet_port: int, kubelet_version: str, since: str, disk_bytes: int
) -> JSON:
    resources = capacity(cfg, disk_bytes)
    return {
        "capacity": resources,
        "allocatable": dict(resources),
        "conditions": conditions(True, since, now()),
        "addresses": [
            {"type": "InternalIP", "address": cfg.ip},
            {"type": "Hostname", "address": cfg.name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "machineID": _read("/etc/machine-id", cfg.name),
            "systemUUID": _read("/sys/class/dmi/id/product_uuid", cfg.name),
            "bootID": _read("/proc/sys/kernel/random/boot_id"),
            "kernelVersion": platform.release(),
            "osImage": _os_image(),
            "containerRuntimeVersion": RUNTIME_VERSION,
            "kubeletVersion": kubelet_version,
            "operatingSystem": "linux",
            "architecture": _arch(),
        },
    }


def node_manifest(cfg: NodeConfig) -> JSON:
    spec: JSON = {"podCIDR": cfg.pod_cidr, "podCIDRs": [cfg.pod_cidr]}
    if cfg.taints:
        spec["taints"] = [dict(t) for t in cfg.taints]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": cfg.name,
            "labels": node_labels(cfg),
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": spec,
    }


class NodeHeartbeat:
    """One Node's registration, Lease and status loop."""

    def __init__(
        self, kube: Kube, cfg: NodeConfig, kubelet_port: int, kubelet_version: str, disk: Path
    ) -> None:
        self.kube = kube
        self.cfg = cfg
        self.kubelet_port = kubelet_port
        self.kubelet_version = kubelet_version
        self.disk = disk
        self.uid = ""
        self._since = now()

    def status(self) -> JSON:
        return node_status(
            self.cfg,
            kubelet_port=self.kubelet_port,
            kubelet_version=self.kubelet_version,
            since=self._since,
            disk_bytes=shutil.disk_usage(self.disk).total,
        )

    async def register(self) -> None:
        """Create the Node (or adopt the one a previous agent registered) and post status."""
        path = f"/api/v1/nodes/{self.cfg.name}"
        try:
            node = await self.kube.create("/api/v1/nodes", self.node_with_status())
        except ApiError as err:
            if err.status != 409:
                raise
            manifest = node_manifest(self.cfg)
            node = await self.kube.patch(
                path, {"metadata": {"labels": manifest["metadata"]["labels"]}}
            )
        self.uid = node["metadata"]["uid"]
        await self.post_status()
        await self.renew_lease()

    def node_with_status(self) -> JSON:
        return {**node_manifest(self.cfg), "status": self.status()}

    async def post_status(self) -> None:
        await self.kube.patch(f"/api/v1/nodes/{self.cfg.name}/status", {"status": self.status()})

    async def renew_lease(self) -> None:
        name = self.cfg.name
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}"
        spec = {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": micro_now(),
        }
        try:
            await self.kube.patch(path, {"spec": spec}, kind="merge")
        except ApiError as err:
            if err.status != 404:
                raise
            lease: dict[str, Any] = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {
                    "name": name,
                    "namespace": LEASE_NAMESPACE,
                    "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": name, "uid": self.uid}
                    ],
                },
                "spec": spec,
            }
            await self.kube.create(
                f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", lease
            )

    async def run(self) -> None:
        """Renew the Lease every 10 s and post status every minute, until cancelled."""
        last_status = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(RENEW_SECONDS)
            try:
                await self.renew_lease()
                if asyncio.get_running_loop().time() - last_status >= STATUS_SECONDS:
                    await self.post_status()
                    last_status = asyncio.get_running_loop().time()
            except TRANSIENT as err:
                log.warning(
                    "node heartbeat failed", extra={"node": self.cfg.name, "error": str(err)}
                )
