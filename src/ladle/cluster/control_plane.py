"""Start, check and stop a local control plane: etcd, kube-apiserver, controller-manager,
scheduler, kwok and the node agent, all on loopback with ports picked free so that clusters
never clash.

Processes run in their own sessions and outlive ``ladle cluster up``; their pids and start
times go into ``state.json`` so that ``down`` stops exactly those processes and nothing else.
The node agent's local nodes live on a loopback subnet of their own, 127.B.0.0/16 with B picked
free: node i answers on 127.B.0.(i+1) and its pods get 127.B.(i+1).0/24.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import random
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from ladle.cluster import build, nodes, pki
from ladle.cluster.agent import podnet
from ladle.cluster.agent.config import KUBELET_PORT, AgentConfig, NodeConfig
from ladle.cluster.agent.containers import stop_all
from ladle.words import plural

HOST = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"
# kube-controller-manager's client rate limit. Its default (20 requests/s per controller) is
# sized for a shared production API server; here it throttled the Deployment controller so
# hard that 500 Deployments took 119 s to become Available with no operator running at all.
CONTROLLER_API_QPS = 200
POD_CIDR = "10.244.0.1/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# Stop order: dependents first, so nothing logs a storm of errors about a vanished apiserver.
STOP_ORDER = (
    "node-agent",
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
)
PORT_NAMES = (
    "etcd",
    "etcd-peer",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)
NODE_LEASE_SECONDS = 40  # what kubelets use
# The CPU a local node advertises. Requests are scheduling facts here (nothing enforces them),
# and examples ask for 2 CPUs a replica on a 2-core machine; 8 fits several replicas per node.
LOCAL_CPU = "8"
LOCAL_GPUS = 4
# How long `down` gives containers between SIGTERM and SIGKILL.
CONTAINER_STOP_SECONDS = 10.0


class ClusterError(RuntimeError):
    """The cluster failed to start or is not running; the message names the component."""


@dataclass(frozen=True)
class Options:
    nodes: int = 2
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H200"
    timeout: float = 180.0
    # Local nodes: real pods, run as processes by the node agent.
    local_nodes: int = 2
    local_cpu: str = LOCAL_CPU
    # Bytes; 0 means the machine's memory (each node advertises all of it).
    local_memory: int = 0
    local_gpus: int = LOCAL_GPUS
    # Taint local nodes NoSchedule, so that only pods that tolerate it become processes. None:
    # only when kwok nodes run beside them (the tests' cluster, whose kwok pods must stay fake).
    local_taint: bool | None = None

    def tainted(self) -> bool:
        return self.nodes > 0 if self.local_taint is None else self.local_taint


def used_loopback_subnets() -> set[int]:
    """Second octets of 127.x.y.z addresses something listens on (from /proc/net/tcp)."""
    used = set()
    for table in ("/proc/net/tcp", "/proc/net/udp"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                local = line.split()[1].split(":")[0]
                octets = [int(local[i : i + 2], 16) for i in (6, 4, 2, 0)]
                if octets[0] == 127:
                    used.add(octets[1])
    return used


def pick_subnet() -> int:
    """A second octet B for 127.B.0.0/16 that nothing on this machine listens in."""
    free = [b for b in range(16, 255) if b not in used_loopback_subnets()]
    if not free:
        raise ClusterError("no free 127.B.0.0/16 subnet left for local nodes")
    return random.choice(free)


def local_node_configs(opts: Options, subnet: int) -> list[NodeConfig]:
    memory = opts.local_memory or psutil.virtual_memory().total
    taints = (
        [{"key": nodes.LOCAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}]
        if opts.tainted()
        else []
    )
    return [
        NodeConfig(
            name=f"{nodes.LOCAL_NODE_PREFIX}{index}",
            ip=f"127.{subnet}.0.{index + 1}",
            pod_cidr=f"127.{subnet}.{index + 1}.0/24",
            cpu=opts.local_cpu,
            memory_bytes=memory,
            gpus=opts.local_gpus,
            gpu_product=opts.gpu_product,
            gpu_memory_mib=nodes.H200_MEMORY_MIB,
            taints=taints,
        )
        for index in range(opts.local_nodes)
    ]


def free_ports(count: int) -> list[int]:
    """Distinct ports the kernel considers free right now (all held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((HOST, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def _write_kubeconfig(path: Path, server: str, ca: Path, client: pki.CertPair, user: str) -> None:
    """A kubeconfig with everything embedded, so it can be copied anywhere and still work."""

    def b64(file: Path) -> str:
        return base64.b64encode(file.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "ladle", "cluster": {"server": server, "certificate-authority-data": b64(ca)}}
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(client.cert),
                    "client-key-data": b64(client.key),
                },
            }
        ],
        "contexts": [{"name": "ladle", "context": {"cluster": "ladle", "user": user}}],
        "current-context": "ladle",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


def _ready(node: dict[str, Any]) -> str:
    """The status of a Node's Ready condition: "True", "False" or "Unknown"."""
    for condition in node.get("status", {}).get("conditions", []):
        if condition["type"] == "Ready":
            return str(condition["status"])
    return "Unknown"


class Cluster:
    """One control plane rooted in ``state_dir`` (certificates, etcd data, logs, state.json)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir.resolve()

    # -- paths ---------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "admin.kubeconfig"

    @property
    def shell_env(self) -> str:
        """The shell line that selects this cluster and puts the built kubectl and helm first
        on PATH (an older kubectl elsewhere on PATH would otherwise answer)."""
        return (
            f'export PATH={shlex.quote(str(build.bin_dir()))}:"$PATH" '
            f"KUBECONFIG={shlex.quote(str(self.kubeconfig))}"
        )

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def agent_dir(self) -> Path:
        return self.state_dir / "agent"

    def state(self) -> dict[str, Any]:
        if not self.state_file.is_file():
            raise ClusterError(f"no cluster in {self.state_dir} (no state.json)")
        result: dict[str, Any] = json.loads(self.state_file.read_text())
        return result

    @property
    def server(self) -> str:
        return str(self.state()["server"])

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    # -- processes -----------------------------------------------------------------------------
    def _live(self, record: dict[str, Any]) -> psutil.Process | None:
        """The recorded process if it still runs; a pid reused by another program is not ours."""
        try:
            proc = psutil.Process(int(record["pid"]))
            if abs(proc.create_time() - float(record["create_time"])) > 1.0:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    def running(self) -> dict[str, bool]:
        """Component name → whether its recorded process is alive."""
        processes: dict[str, dict[str, Any]] = self.state().get("processes", {})
        return {name: self._live(rec) is not None for name, rec in processes.items()}

    def _start(self, state: dict[str, Any], name: str, argv: list[str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                start_new_session=True,
            )
        state["processes"][name] = {
            "pid": proc.pid,
            "create_time": psutil.Process(proc.pid).create_time(),
            "argv": argv,
        }
        self._save(state)

    # -- talking to components -----------------------------------------------------------------
    def _admin_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki_dir / "ca.crt"))
        ctx.load_cert_chain(str(self.pki_dir / "admin.crt"), str(self.pki_dir / "admin.key"))
        return ctx

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One admin request to the API server; returns decoded JSON (or text for health)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        with urllib.request.urlopen(request, context=self._admin_context(), timeout=10) as rsp:
            raw = rsp.read().decode()
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def _healthy(self, port: int) -> bool:
        """kube-controller-manager/scheduler /healthz (their self-signed serving certs)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            url = f"https://{HOST}:{port}/healthz"
            with urllib.request.urlopen(url, context=ctx, timeout=5) as rsp:
                return bool(rsp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def _wait(self, what: str, check: Callable[[], bool], deadline: float) -> None:
        while True:
            self._assert_alive()
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                if check():
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out waiting for {what}\n{self.log_tails()}")
            time.sleep(0.25)

    def _assert_alive(self) -> None:
        dead = [name for name, alive in self.running().items() if not alive]
        if dead:
            raise ClusterError(f"{', '.join(dead)} exited during start-up\n{self.log_tails()}")

    def log_tails(self, lines: int = 40) -> str:
        """The last lines of every component log: what a failure report needs."""
        parts = []
        for log in sorted(self.log_dir.glob("*.log")) if self.log_dir.is_dir() else []:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            heading = f"----- {log.name} (last {plural(len(tail), 'line')}) -----"
            parts.append(heading + "\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- lifecycle -----------------------------------------------------------------------------
    def up(self, options: Options | None = None) -> float:
        """Start everything and wait until the cluster is Ready; returns the seconds it took.

        Ready means: the API server's /readyz passes, the controller-manager and scheduler are
        healthy, every fake node is Ready without the not-ready taint (so node-lifecycle runs),
        and the ``default`` ServiceAccount exists (so the serviceaccount controller runs).
        """
        opts = options or Options()
        start = time.monotonic()
        deadline = start + opts.timeout
        if self.state_file.is_file():
            if any(self.running().values()):
                raise ClusterError(f"a cluster already runs from {self.state_dir}; `down` first")
            shutil.rmtree(self.state_dir)
        bins = build.bin_dir()
        if missing := build.missing():
            raise ClusterError(f"not built: {', '.join(missing)}; run `ladle cluster build`")
        if opts.local_nodes:
            self._check_local_nodes()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        server = f"https://{HOST}:{ports['kube-apiserver']}"
        local = local_node_configs(opts, pick_subnet()) if opts.local_nodes else []
        state: dict[str, Any] = {
            "server": server,
            "ports": ports,
            "bin_dir": str(bins),
            "options": vars(opts),
            "cluster_id": uuid.uuid4().hex[:12],
            "local_nodes": [node.name for node in local],
            "processes": {},
        }
        self._save(state)
        try:
            self._write_pki(server, [node.ip for node in local])
            self._start(state, "etcd", self._etcd_argv(bins, ports))
            self._start(state, "kube-apiserver", self._apiserver_argv(bins, ports))
            self._wait(
                "kube-apiserver /readyz", lambda: self.api("GET", "/readyz") == "ok", deadline
            )
            for index in range(opts.nodes):
                node = nodes.gpu_node(index, gpus=opts.gpus_per_node, product=opts.gpu_product)
                self.api("POST", "/api/v1/nodes", node)
            if local:
                self._write_agent_config(state, local)
                self._start(state, "node-agent", self._agent_argv())
            self._start(state, "kube-controller-manager", self._kcm_argv(bins, ports))
            self._start(state, "kube-scheduler", self._scheduler_argv(bins, ports))
            if opts.nodes:
                self._start(state, "kwok", self._kwok_argv(bins, ports))
            for name in ("kube-controller-manager", "kube-scheduler"):
                self._wait(
                    f"{name} /healthz", functools.partial(self._healthy, ports[name]), deadline
                )
            self._wait(
                f"{plural(opts.nodes, 'Ready kwok node')} and "
                f"{plural(len(local), 'Ready local node')}",
                lambda: self._nodes_ready(opts),
                deadline,
            )
            self._wait(
                "the default ServiceAccount",
                lambda: bool(self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")),
                deadline,
            )
        except BaseException:
            self.stop_processes()
            raise
        elapsed = time.monotonic() - start
        state["ready_seconds"] = round(elapsed, 2)
        self._save(state)
        return elapsed

    @staticmethod
    def _check_local_nodes() -> None:
        """What the node agent needs, said before anything starts."""
        if os.geteuid() != 0:
            raise ClusterError(
                "local nodes need root: the node agent gives every container a private mount "
                "namespace; run as root, or pass --local-nodes 0 for kwok's nodes only"
            )
        try:
            podnet.build()
        except podnet.ShimError as err:
            raise ClusterError(f"{err}; or pass --local-nodes 0 for kwok's nodes only") from err

    def _nodes_ready(self, opts: Options) -> bool:
        ready = {"kwok": 0, "local": 0}
        for node in self.api("GET", "/api/v1/nodes")["items"]:
            kind = node["metadata"].get("labels", {}).get("type")
            taints = [t["key"] for t in node.get("spec", {}).get("taints", [])]
            if (
                kind in ready
                and _ready(node) == "True"
                and "node.kubernetes.io/not-ready" not in taints
            ):
                ready[kind] += 1
        return ready["kwok"] >= opts.nodes and ready["local"] >= opts.local_nodes

    def stop_processes(self, grace: float = 10.0) -> list[str]:
        """Terminate the recorded processes (dependents first) and every container the node
        agent started; returns the names stopped."""
        if not self.state_file.is_file():
            return []
        state = self.state()
        processes: dict[str, dict[str, Any]] = state.get("processes", {})
        stopped = []
        for name in STOP_ORDER:
            record = processes.get(name)
            proc = self._live(record) if record else None
            if proc is not None:
                self._terminate(proc, grace)
                stopped.append(name)
            # The agent leaves its containers running when it stops (a kubelet restart must
            # not kill pods), so `down` ends them itself.
            if (
                name == "node-agent"
                and state.get("cluster_id")
                and stop_all(state["cluster_id"], self.agent_dir, CONTAINER_STOP_SECONDS)
            ):
                stopped.append("containers")
        return stopped

    @staticmethod
    def _terminate(proc: psutil.Process, grace: float) -> None:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
            _, alive = psutil.wait_procs([proc], timeout=grace)
            for straggler in alive:
                straggler.kill()
            psutil.wait_procs(alive, timeout=grace)

    def stop_agent(self) -> None:
        """Stop the node agent alone; its containers keep running, as pods do when a kubelet
        restarts."""
        record = self.state()["processes"]["node-agent"]
        if (proc := self._live(record)) is not None:
            self._terminate(proc, 10.0)

    def start_agent(self, timeout: float = 60.0) -> float:
        """Start the node agent again and wait until it has adopted its pods; returns seconds."""
        state = self.state()
        start = time.monotonic()
        self._start(state, "node-agent", state["processes"]["node-agent"]["argv"])
        self._wait("the restarted node agent", self.agent_healthy, start + timeout)
        return time.monotonic() - start

    def agent_healthy(self) -> bool:
        """The agent's kubelet endpoint answers /healthz: it has adopted its pods and runs."""
        config = AgentConfig.load(self.state_dir / "agent.json")
        url = f"https://{config.nodes[0].ip}:{KUBELET_PORT}/healthz"
        with urllib.request.urlopen(url, context=self._admin_context(), timeout=5) as rsp:
            return bool(rsp.status == 200)

    def restart_apiserver(self, timeout: float = 90.0) -> float:
        """Stop kube-apiserver and start it again with the same flags, for resilience tests
        (clients must survive it); returns the seconds until workloads run again.

        /readyz alone is not enough: the controllers' watches come back with a backoff, and
        until they do, the ReplicaSet controller refuses to act on its stale cache. Waiting for
        a probe Deployment keeps the restart from leaking into the tests that follow."""
        state = self.state()
        record = state["processes"]["kube-apiserver"]
        proc = self._live(record)
        start = time.monotonic()
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
                _, alive = psutil.wait_procs([proc], timeout=10)
                for straggler in alive:
                    straggler.kill()
        self._start(state, "kube-apiserver", record["argv"])
        deadline = start + timeout
        self._wait("kube-apiserver /readyz", lambda: self.api("GET", "/readyz") == "ok", deadline)
        self._wait_for_a_workload(deadline)
        return time.monotonic() - start

    def _wait_for_a_workload(self, deadline: float) -> None:
        """Run a one-pod Deployment to Available and delete it: proof that the Deployment and
        ReplicaSet controllers, the scheduler and kwok all see the API server again."""
        name = f"ladle-probe-{uuid.uuid4().hex[:8]}"
        path = "/apis/apps/v1/namespaces/default/deployments"
        labels = {"app.kubernetes.io/name": name}
        probe = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "probe", "image": "ladle.dev/probe"}]},
                },
            },
        }

        def create() -> bool:
            try:
                self.api("POST", path, probe)
            except urllib.error.HTTPError as err:
                if err.code != 409:  # a retry after a lost response finds it there
                    raise
            return True

        self._wait("the API server to accept a probe Deployment", create, deadline)
        try:
            self._wait(
                "a probe Deployment to become Available",
                lambda: (
                    (self.api("GET", f"{path}/{name}").get("status") or {}).get("availableReplicas")
                    == 1
                ),
                deadline,
            )
        finally:
            with contextlib.suppress(OSError, urllib.error.URLError):
                self.api("DELETE", f"{path}/{name}?propagationPolicy=Background")

    def down(self) -> list[str]:
        """Stop our processes and remove the state folder."""
        stopped = self.stop_processes()
        if self.state_dir.is_dir():
            shutil.rmtree(self.state_dir)
        return stopped

    def status(self) -> dict[str, Any]:
        """What ``ladle cluster status`` prints: processes, API health and node readiness."""
        state = self.state()
        report: dict[str, Any] = {
            "state_dir": str(self.state_dir),
            "kubeconfig": str(self.kubeconfig),
            "server": state["server"],
            "processes": self.running(),
        }
        try:
            report["readyz"] = self.api("GET", "/readyz")
            node_list = self.api("GET", "/api/v1/nodes")["items"]
            report["nodes"] = {n["metadata"]["name"]: _ready(n) for n in node_list}
        except (OSError, urllib.error.URLError) as exc:
            report["readyz"] = f"unreachable: {exc}"
        return report

    # -- configuration -------------------------------------------------------------------------
    def _write_agent_config(self, state: dict[str, Any], local: list[NodeConfig]) -> None:
        p = self.pki_dir
        AgentConfig(
            cluster_id=state["cluster_id"],
            server=state["server"],
            ca_file=str(p / "ca.crt"),
            cert_file=str(p / "node-agent.crt"),
            key_file=str(p / "node-agent.key"),
            serving_cert_file=str(p / "kubelet.crt"),
            serving_key_file=str(p / "kubelet.key"),
            client_ca_file=str(p / "ca.crt"),
            state_dir=str(self.agent_dir),
            nodes=local,
        ).dump(self.state_dir / "agent.json")

    def _agent_argv(self) -> list[str]:
        return [sys.executable, "-m", "ladle.cluster.agent", str(self.state_dir / "agent.json")]

    def _write_pki(self, server: str, node_ips: list[str]) -> None:
        ca = pki.CertificateAuthority(self.pki_dir)
        ca.issue(
            "apiserver",
            "kube-apiserver",
            server=True,
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ips=(HOST, "10.96.0.1"),
        )
        pki.service_account_keys(self.pki_dir)
        # The aggregation layer's identity; without it every component logs errors about the
        # missing requestheader CA, and aggregated API servers could not be tested at all.
        ca.issue("front-proxy-client", "front-proxy-client")
        # The API server's identity towards kubelets (logs), and the kubelet endpoint's own.
        ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        if node_ips:
            ca.issue(
                "kubelet",
                "ladle-node-agent",
                server=True,
                dns_names=("localhost",),
                ips=tuple(node_ips),
            )
            ca.issue("node-agent", "ladle-node-agent", "system:masters")
        identities = {
            # The admin and kwok act as cluster-admins; the other two get their bootstrap roles.
            "admin": ("ladle-admin", "system:masters"),
            "kwok": ("kwok", "system:masters"),
            "kube-controller-manager": ("system:kube-controller-manager", None),
            "kube-scheduler": ("system:kube-scheduler", None),
        }
        for stem, (common_name, org) in identities.items():
            pair = ca.issue(stem, common_name, org)
            target = self.kubeconfig if stem == "admin" else self.pki_dir / f"{stem}.kubeconfig"
            _write_kubeconfig(target, server, ca.pair.cert, pair, common_name)

    def _etcd_argv(self, bins: Path, ports: dict[str, int]) -> list[str]:
        client = f"http://{HOST}:{ports['etcd']}"
        peer = f"http://{HOST}:{ports['etcd-peer']}"
        return [
            str(bins / "etcd"),
            "--name=ladle",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=ladle={peer}",
            # A test cluster's data is disposable; skipping fsync makes every write much faster.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def _apiserver_argv(self, bins: Path, ports: dict[str, int]) -> list[str]:
        p = self.pki_dir
        return [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://{HOST}:{ports['etcd']}",
            f"--bind-address={HOST}",
            f"--advertise-address={HOST}",
            # The endpoint reconciler refuses loopback addresses; nothing in-cluster dials the
            # `kubernetes` Service on fake nodes anyway.
            "--endpoint-reconciler-type=none",
            f"--secure-port={ports['kube-apiserver']}",
            f"--cert-dir={p}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            f"--requestheader-client-ca-file={p / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
            # `kubectl logs` goes through the local nodes' kubelet endpoint (the node agent),
            # at the InternalIP each reports, with a certificate this CA verifies.
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={p / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # A namespace annotated for it puts its pods on the local nodes (node selector and
            # toleration), so tests can run real pods beside kwok's fake ones.
            "--enable-admission-plugins=PodNodeSelector,PodTolerationRestriction",
            "--profiling=false",
        ]

    def _component_common(self, name: str, ports: dict[str, int]) -> list[str]:
        kubeconfig = self.pki_dir / f"{name}.kubeconfig"
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--bind-address={HOST}",
            f"--secure-port={ports[name]}",
            f"--cert-dir={self.state_dir / name}",
            # One instance per cluster: leader election would only add seconds to start-up.
            "--leader-elect=false",
            "--profiling=false",
        ]

    def _kcm_argv(self, bins: Path, ports: dict[str, int]) -> list[str]:
        return [
            str(bins / "kube-controller-manager"),
            *self._component_common("kube-controller-manager", ports),
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--root-ca-file={self.pki_dir / 'ca.crt'}",
            f"--service-account-private-key-file={self.pki_dir / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--kube-api-qps={CONTROLLER_API_QPS}",
            f"--kube-api-burst={2 * CONTROLLER_API_QPS}",
        ]

    def _scheduler_argv(self, bins: Path, ports: dict[str, int]) -> list[str]:
        return [
            str(bins / "kube-scheduler"),
            *self._component_common("kube-scheduler", ports),
        ]

    def _kwok_argv(self, bins: Path, ports: dict[str, int]) -> list[str]:
        stages = ",".join(str(build.stages_dir() / Path(s).name) for s in build.KWOK_STAGES)
        return [
            str(bins / "kwok"),
            f"--kubeconfig={self.pki_dir / 'kwok.kubeconfig'}",
            f"--config={stages}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={nodes.KWOK_SELECTOR}",
            # Renew node Leases like kubelets do. The flag's default only applies through a
            # KwokConfiguration, and without Leases node-lifecycle marks every node (and its
            # pods) NotReady for a few seconds each node-monitor grace period.
            f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
            f"--cidr={POD_CIDR}",
            f"--node-ip={HOST}",
            f"--server-address={HOST}:{ports['kwok']}",
        ]
