"""The local nodes' network: one network namespace per cluster, joined to the host by a veth
pair and routed nowhere else.

Everything a local node runs (containerd, the kubelet, kube-proxy and every pod) lives in that
namespace or in a pod's own namespace inside it, so two clusters on one machine never share an
iptables rule, and ``down`` removes all of it by deleting one namespace. The cluster owns
``10.B.0.0/16`` (B picked free of the host's routes):

- ``10.B.0.1`` is the host's end of the veth. The API server listens there, so pods reach it
  (through the ``kubernetes`` Service and kube-proxy) and so does the host;
- ``10.B.0.2`` is the namespace's end; the host routes ``10.B.0.0/16`` to it;
- node i answers on ``10.B.0.(10+i)`` and gives its pods ``10.B.(i+1).0/24``, each pod on a
  point-to-point veth (CNI's ``ptp``), so that all pod traffic is routed, and seen by
  kube-proxy's rules, in the cluster's namespace;
- Services get ``10.B.128.0/17``.

Pods have routes to ``10.B.0.0/16`` only, and the host forwards nothing (forwarding is turned
on inside the cluster's namespace alone): no traffic leaves the machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

NETNS_DIR = Path("/run/netns")
# The namespace's end of the veth, inside the cluster's namespace.
INNER_LINK = "host0"
FIRST_NODE_HOST = 10
# Second octets the field's defaults use (Services 10.96/12 and kwok's pod IPs 10.244/16):
# never picked, so that addresses in a log are never ambiguous.
RESERVED_BLOCKS = frozenset({96, 244})


class NetworkError(RuntimeError):
    """An ``ip`` command failed; the message carries its output."""


@dataclass(frozen=True)
class Plan:
    """The addresses of one cluster's network, all derived from its block."""

    block: int
    name: str

    @property
    def cidr(self) -> str:
        return f"10.{self.block}.0.0/16"

    @property
    def cluster_cidr(self) -> str:
        """Where pod IPs come from (kube-proxy tells pod traffic from the rest by it)."""
        return f"10.{self.block}.0.0/17"

    @property
    def service_cidr(self) -> str:
        return f"10.{self.block}.128.0/17"

    @property
    def kubernetes_service_ip(self) -> str:
        """The ``kubernetes`` Service's ClusterIP: the first of the range."""
        return f"10.{self.block}.128.1"

    @property
    def host_ip(self) -> str:
        return f"10.{self.block}.0.1"

    @property
    def inner_ip(self) -> str:
        return f"10.{self.block}.0.2"

    def node_ip(self, index: int) -> str:
        return f"10.{self.block}.0.{FIRST_NODE_HOST + index}"

    def pod_cidr(self, index: int) -> str:
        return f"10.{self.block}.{index + 1}.0/24"

    @property
    def netns(self) -> str:
        return self.name

    @property
    def host_link(self) -> str:
        # Interface names hold 15 characters.
        return self.name[:15]

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    def enter(self, namespaces: list[str], argv: list[str]) -> list[str]:
        """``argv`` run inside the cluster's network namespace, and the other ``namespaces``
        (nsenter's options, such as ``--mount=FILE``)."""
        return ["nsenter", f"--net={self.netns_path}", *namespaces, "--", *argv]


def _host_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the host has a route or an address in, the default route aside."""
    networks = []
    for args in (["-4", "route", "show", "table", "all"], ["-4", "-o", "addr", "show"]):
        out = subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            words = line.split()
            candidates = words[3:4] if "addr" in args else words[:1]
            for word in candidates:
                if word[0].isdigit():
                    with contextlib.suppress(ValueError):
                        networks.append(ipaddress.IPv4Network(word, strict=False))
    return [net for net in networks if net.prefixlen > 0]


def free_blocks(taken: list[ipaddress.IPv4Network]) -> list[int]:
    """Second octets B whose 10.B.0.0/16 overlaps none of ``taken``."""
    return [
        block
        for block in range(16, 255)
        if block not in RESERVED_BLOCKS
        and not any(ipaddress.IPv4Network(f"10.{block}.0.0/16").overlaps(net) for net in taken)
    ]


def plan(cluster_id: str) -> Plan:
    """A plan on a block nothing on this host uses, named after the cluster."""
    blocks = free_blocks(_host_networks())
    if not blocks:
        raise NetworkError("no free 10.B.0.0/16 left for the local nodes' network")
    return Plan(block=random.choice(blocks), name=f"ladle{cluster_id[:10]}")


def _ip(*args: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def create(net: Plan, nodes: int) -> None:
    """The namespace, its veth to the host, the nodes' addresses and the routes."""
    _ip("netns", "add", net.netns)
    ns = ("-n", net.netns)
    _ip(
        "link", "add", net.host_link, "type", "veth", "peer", "name", INNER_LINK, "netns", net.netns
    )
    _ip("addr", "add", net.host_ip, "peer", net.inner_ip, "dev", net.host_link)
    _ip("link", "set", net.host_link, "up")
    _ip(*ns, "link", "set", "lo", "up")
    _ip(*ns, "addr", "add", net.inner_ip, "peer", net.host_ip, "dev", INNER_LINK)
    _ip(*ns, "link", "set", INNER_LINK, "up")
    for index in range(nodes):
        _ip(*ns, "addr", "add", f"{net.node_ip(index)}/32", "dev", "lo")
    _ip("route", "add", net.cidr, "via", net.inner_ip, "dev", net.host_link)
    # Pods on different nodes reach each other, and Services, through this namespace.
    subprocess.run(
        net.enter([], ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]),
        check=True,
        capture_output=True,
    )


def destroy(net: Plan) -> None:
    """Remove the veth (both ends, and the host's route with them) and the namespace; what is
    already gone is fine."""
    _ip("link", "del", net.host_link, check=False)
    _ip("netns", "del", net.netns, check=False)


def exists(net: Plan) -> bool:
    return net.netns_path.exists()
