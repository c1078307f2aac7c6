"""Start, check and stop a local cluster: etcd, kube-apiserver, controller-manager, scheduler
and kwok on the host, and local nodes (containerd, the kubelet and kube-proxy) in a network
namespace of the cluster's own, with ports picked free so that clusters never clash.

Processes run in their own sessions and outlive ``ladle cluster up``; their pids and start
times go into ``state.json`` so that ``down`` stops exactly those processes and nothing else,
then removes what they leave: pods (through the CRI), mounts, cgroups and the namespace.
Without local nodes the API server listens on loopback; with them, on the host's end of the
cluster's veth (``ladle_dev.cluster.network``), where pods reach it too.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import shlex
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from ladle.words import plural
from ladle_dev.cluster import build, images, network, nodes, pki
from ladle_dev.cluster.node import (
    LocalNode,
    NodeError,
    NodeSpec,
    private_run_root,
    release_run_root,
    share_layers,
)

HOST = "127.0.0.1"
# The Service range of a cluster without local nodes (with them, the network plan's).
SERVICE_CIDR = "10.96.0.0/16"
# kube-controller-manager's client rate limit. Its default (20 requests/s per controller) is
# sized for a shared production API server; here it throttled the Deployment controller so
# hard that 500 Deployments took 119 s to become Available with no operator running at all.
CONTROLLER_API_QPS = 200
POD_CIDR = "10.244.0.1/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
PORT_NAMES = (
    "etcd",
    "etcd-peer",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
)
NODE_LEASE_SECONDS = 40  # what kubelets use
LOCAL_GPUS = 4
# What a local node's images are: the pod sandbox and Ladle's two.
NODE_IMAGES = (images.PAUSE, *(image.reference for image in images.IMAGES))
# Room beyond the nodes' images: their pods' logs, writable layers and emptyDirs, and etcd.
DISK_HEADROOM = 2 * 2**30


_SAVING = threading.Lock()


class ClusterError(RuntimeError):
    """The cluster failed to start or is not running; the message names the component."""


@dataclass(frozen=True)
class Options:
    nodes: int = 2
    gpus_per_node: int = 8
    gpu_product: str = "NVIDIA-H200"
    timeout: float = 300.0
    # Local nodes: a real kubelet and containerd each, running Ladle's images.
    local_nodes: int = 2
    local_gpus: int = LOCAL_GPUS
    # Taint local nodes NoSchedule, so that only pods that tolerate it run there. None: only
    # when kwok nodes run beside them (the tests' cluster, whose kwok pods must stay fake).
    local_taint: bool | None = None

    def tainted(self) -> bool:
        return self.nodes > 0 if self.local_taint is None else self.local_taint


def local_node_specs(opts: Options, net: network.Plan) -> list[NodeSpec]:
    taints = (f"{nodes.LOCAL_NODE_LABEL}=true:NoSchedule",) if opts.tainted() else ()
    return [
        NodeSpec(
            index=index,
            name=f"{nodes.LOCAL_NODE_PREFIX}{index}",
            ip=net.node_ip(index),
            pod_cidr=net.pod_cidr(index),
            labels=nodes.local_labels(opts.gpu_product, opts.local_gpus),
            taints=taints,
        )
        for index in range(opts.local_nodes)
    ]


def free_ports(count: int, host: str = HOST) -> list[int]:
    """Distinct ports the kernel considers free right now (all held open until all are chosen)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
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

    def state(self) -> dict[str, Any]:
        if not self.state_file.is_file():
            raise ClusterError(f"no cluster in {self.state_dir} (no state.json)")
        result: dict[str, Any] = json.loads(self.state_file.read_text())
        return result

    @property
    def server(self) -> str:
        return str(self.state()["server"])

    def _save(self, state: dict[str, Any]) -> None:
        with _SAVING:  # nodes start on threads of their own
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

    def _start(
        self,
        state: dict[str, Any],
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.state_dir,
                env=env,
                start_new_session=True,
            )
        state["processes"][name] = {
            "pid": proc.pid,
            "create_time": psutil.Process(proc.pid).create_time(),
            "argv": argv,
            "env": env,
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
    def up(self, options: Options | None = None, *, start_local: bool = True) -> float:
        """Start everything and wait until the cluster is Ready; returns the seconds it took.

        Ready means: the API server's /readyz passes, the controller-manager and scheduler are
        healthy, every node is Ready without the not-ready taint (so node-lifecycle runs), and
        the ``default`` ServiceAccount exists (so the serviceaccount controller runs).
        """
        opts = options or Options()
        start = time.monotonic()
        deadline = start + opts.timeout
        if self.state_file.is_file():
            if any(self.running().values()):
                raise ClusterError(f"a cluster already runs from {self.state_dir}; `down` first")
            self.down()
        bins = build.bin_dir()
        if missing := build.missing():
            raise ClusterError(f"not built: {', '.join(missing)}; run `ladle cluster build`")
        if opts.local_nodes:
            self._check_local_nodes()
            if start_local:
                self._check_disk(opts.local_nodes)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        cluster_id = uuid.uuid4().hex[:12]
        net = network.plan(cluster_id) if opts.local_nodes else None
        ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES)), strict=True))
        server = f"https://{net.host_ip if net else HOST}:{ports['kube-apiserver']}"
        specs = local_node_specs(opts, net) if net else []
        state: dict[str, Any] = {
            "server": server,
            "ports": ports,
            "bin_dir": str(bins),
            "options": vars(opts),
            "cluster_id": cluster_id,
            "network": {"block": net.block, "name": net.name} if net else None,
            "local_nodes": [spec.name for spec in specs],
            "processes": {},
        }
        self._save(state)
        try:
            self._write_pki(server, net, specs)
            if net:
                network.create(net, len(specs))
            self._start(state, "etcd", self._etcd_argv(bins, ports))
            self._start(state, "kube-apiserver", self._apiserver_argv(bins, ports, net))
            self._wait(
                "kube-apiserver /readyz", lambda: self.api("GET", "/readyz") == "ok", deadline
            )
            for index in range(opts.nodes):
                node = nodes.gpu_node(index, gpus=opts.gpus_per_node, product=opts.gpu_product)
                self.api("POST", "/api/v1/nodes", node)
            self._start(state, "kube-controller-manager", self._kcm_argv(bins, ports, net))
            self._start(state, "kube-scheduler", self._scheduler_argv(bins, ports))
            if opts.nodes:
                self._start(state, "kwok", self._kwok_argv(bins, ports))
            for name in ("kube-controller-manager", "kube-scheduler"):
                self._wait(
                    f"{name} /healthz", functools.partial(self._healthy, ports[name]), deadline
                )
            self._wait(
                plural(opts.nodes, "Ready kwok node"),
                lambda: self._nodes_ready("kwok", opts.nodes),
                deadline,
            )
            self._wait(
                "the default ServiceAccount",
                lambda: bool(self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")),
                deadline,
            )
            if start_local:
                self.start_local_nodes(deadline - time.monotonic())
        except BaseException:
            self.stop_processes()
            raise
        elapsed = time.monotonic() - start
        state = self.state()
        state["ready_seconds"] = round(elapsed, 2)
        self._save(state)
        return elapsed

    def start_local_nodes(self, timeout: float = 300.0) -> float:
        """Start the local nodes (containerd with the images imported, the kubelets and
        kube-proxy) and wait until they are Ready; returns the seconds it took. A cluster can be
        started without them (``up(start_local=False)``) and given them when first needed."""
        start = time.monotonic()
        deadline = start + timeout
        state = self.state()
        local = self.local_nodes()
        bins = build.bin_dir()
        if all(self.running().get(f"kubelet-{node.spec.name}") for node in local):
            self._refresh_images(local)
            return time.monotonic() - start
        self._check_disk(len(local))
        opts = Options(**state["options"])
        net = self.network_plan()
        assert net is not None
        private_run_root(state["cluster_id"])
        with ThreadPoolExecutor(len(local)) as pool:
            list(pool.map(functools.partial(self._start_runtime, state), local))
        self._share_layers(local, NODE_IMAGES)
        state = self.state()
        for node in local:
            name = node.spec.name
            kubeconfig = self.pki_dir / f"kubelet-{name}.kubeconfig"
            self._start(
                state, f"kubelet-{name}", node.kubelet_argv(bins, kubeconfig), node.env(bins)
            )
            gpus = node.gpu_plugin_argv(bins, opts.local_gpus)
            self._start(state, f"gpu-plugin-{name}", gpus)
        self._start(state, "kube-proxy", self._kube_proxy_argv(bins, net, local[0].spec))
        for node in local:
            self._wait(
                f"{node.spec.name} to register",
                functools.partial(self._register_local_node, node.spec, opts),
                deadline,
            )
        self._wait(
            plural(len(local), "Ready local node"),
            lambda: self._nodes_ready("local", len(local)),
            deadline,
        )
        return time.monotonic() - start

    @staticmethod
    def _check_local_nodes() -> None:
        """What local nodes need, said before anything starts."""
        if os.geteuid() != 0:
            raise ClusterError(
                "local nodes need root (network namespaces, cgroups, containerd); run as root, "
                "or pass --local-nodes 0 for kwok's nodes only"
            )
        for tool, package in (("nsenter", "util-linux"), ("ip", "iproute2")):
            if shutil.which(tool) is None:
                raise ClusterError(f"local nodes need {tool}: install Debian's {package} package")
        if not (ptp := Path("/usr/lib/cni/ptp")).is_file():
            raise ClusterError(
                f"local nodes need the CNI plugins ({ptp} is missing): install "
                "Debian's containernetworking-plugins package"
            )
        try:
            for reference in NODE_IMAGES:
                images.manifest_descriptor(reference)
        except (build.BuildError, OSError) as err:
            raise ClusterError(f"{err}; or pass --local-nodes 0 for kwok's nodes only") from None

    def _check_disk(self, nodes: int) -> None:
        """Each node unpacks its own copy of the images; say so before a disk fills up under
        the nodes' containerd, whose errors name neither the cause nor the fix."""
        per_node = sum(images.unpacked_size(reference) for reference in NODE_IMAGES)
        need = nodes * per_node + DISK_HEADROOM
        where = next(p for p in (self.state_dir, *self.state_dir.parents) if p.exists())
        free = shutil.disk_usage(where).free
        if free < need:
            raise ClusterError(
                f"{plural(nodes, 'local node')} need about {need / 2**30:.1f} GiB free under "
                f"{self.state_dir} (each unpacks Ladle's images, {per_node / 2**30:.1f} GiB), "
                f"and {free / 2**30:.1f} GiB is: free some space, or start fewer local nodes "
                "(--local-nodes)"
            )

    def local_nodes(self) -> list[LocalNode]:
        """The cluster's local nodes, rebuilt from its state (for stopping and for tests)."""
        state = self.state()
        if not state.get("network"):
            return []
        net = self.network_plan()
        assert net is not None
        opts = Options(**state["options"])
        return [
            LocalNode(self.state_dir, state["cluster_id"], net, spec)
            for spec in local_node_specs(opts, net)
        ]

    def network_plan(self) -> network.Plan | None:
        recorded = self.state().get("network")
        return network.Plan(recorded["block"], recorded["name"]) if recorded else None

    def _start_runtime(self, state: dict[str, Any], node: LocalNode) -> None:
        """containerd for one node, with Ladle's images imported."""
        bins = build.bin_dir()
        p = self.pki_dir
        name = node.spec.name
        node.write_config(bins, p / "ca.crt", (p / f"{name}.crt", p / f"{name}.key"))
        node.create_view()
        self._start(state, f"containerd-{name}", node.containerd_argv(bins), node.env(bins))
        try:
            node.wait_containerd(bins)
            node.import_images(bins, list(NODE_IMAGES))
        except NodeError as err:
            raise ClusterError(f"{err}\n{self.log_tails()}") from None

    def _refresh_images(self, local: list[LocalNode]) -> None:
        """Import into running nodes the images that were rebuilt since they started, so that
        the pods a test starts now run the checkout's code."""
        bins = build.bin_dir()
        imported: set[str] = set()
        for node in local:
            held = node.held_images(bins)
            stale = [ref for ref in NODE_IMAGES if held.get(ref) != images.image_id(ref)]
            if stale:
                node.import_images(bins, stale)
                imported.update(stale)
        if imported:
            self._share_layers(local, tuple(sorted(imported)))

    @staticmethod
    def _share_layers(local: list[LocalNode], references: tuple[str, ...]) -> None:
        try:
            share_layers(local, build.bin_dir(), references)
        except NodeError as err:
            raise ClusterError(str(err)) from None

    def _register_local_node(self, spec: NodeSpec, opts: Options) -> bool:
        """Once the kubelet has registered its Node, give it its pod range (there is no node
        IPAM controller); it is done when the device plugin's GPUs show as allocatable."""
        try:
            node = self.api("GET", f"/api/v1/nodes/{spec.name}")
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return False
            raise
        if not node["spec"].get("podCIDR"):
            cidrs = {"podCIDR": spec.pod_cidr, "podCIDRs": [spec.pod_cidr]}
            self._patch(f"/api/v1/nodes/{spec.name}", {"spec": cidrs})
        gpus = node["status"].get("allocatable", {}).get(nodes.GPU_RESOURCE, "0")
        return bool(gpus == str(opts.local_gpus))

    def _patch(self, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        request = urllib.request.Request(
            self.server + path,
            data=data,
            method="PATCH",
            headers={"Content-Type": "application/strategic-merge-patch+json"},
        )
        with urllib.request.urlopen(request, context=self._admin_context(), timeout=10):
            pass

    def _nodes_ready(self, kind: str, count: int) -> bool:
        """At least ``count`` nodes of ``kind`` (kwok, local) are Ready and untainted."""
        ready = 0
        for node in self.api("GET", "/api/v1/nodes")["items"]:
            taints = [t["key"] for t in node.get("spec", {}).get("taints", [])]
            if (
                node["metadata"].get("labels", {}).get("type") == kind
                and _ready(node) == "True"
                and "node.kubernetes.io/not-ready" not in taints
            ):
                ready += 1
        return ready >= count

    def stop_processes(self, grace: float = 10.0) -> list[str]:
        """Stop the recorded processes, dependents first, and remove what local nodes leave:
        their pods (through the CRI, so CNI and mounts are undone), then any mount, cgroup or
        process still there, and the cluster's network namespace. Returns the names stopped."""
        if not self.state_file.is_file():
            return []
        state = self.state()
        processes: dict[str, dict[str, Any]] = state.get("processes", {})
        local = self.local_nodes()
        bins = Path(state["bin_dir"])
        stopped: list[str] = []
        stages = (
            # Kubelets first, so that nothing restarts what is being removed.
            [f"{kind}-{n.spec.name}" for n in local for kind in ("kubelet", "gpu-plugin")],
            ["kube-proxy", "kwok", "kube-scheduler", "kube-controller-manager"],
            [f"containerd-{n.spec.name}" for n in local],
            ["kube-apiserver", "etcd"],
        )
        for index, names in enumerate(stages):
            stopped += self._stop([(n, processes[n]) for n in names if n in processes], grace)
            if index == 0:
                with ThreadPoolExecutor(max(1, len(local))) as pool:
                    list(pool.map(lambda node: node.remove_pods(bins), local))
            if index == 2:
                _stop_shims([node.socket for node in local])
        for node in local:
            node.clean()
        release_run_root(state["cluster_id"])
        if (net := self.network_plan()) is not None:
            network.destroy(net)
        return stopped

    def _stop(self, records: list[tuple[str, dict[str, Any]]], grace: float) -> list[str]:
        """SIGTERM to each recorded process still alive, all at once; SIGKILL to those alive
        after ``grace``. Polled briefly: they are not our children, so nothing tells us when
        they end (psutil polls a second at a time), and ``down`` stops a dozen in a row."""
        live = {name: proc for name, rec in records if (proc := self._live(rec)) is not None}
        for proc in live.values():
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        deadline = time.monotonic() + grace
        killed = False
        while alive := [proc for proc in live.values() if _running(proc)]:
            if time.monotonic() > deadline and not killed:
                for proc in alive:
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
                killed = True
            elif time.monotonic() > deadline + grace:
                break
            time.sleep(0.05)
        return list(live)

    def stop_component(self, name: str) -> None:
        """Stop one recorded process (a kubelet, say) and leave the rest running."""
        self._stop([(name, self.state()["processes"][name])], 10.0)

    def start_component(self, name: str) -> None:
        """Start a stopped component again with the command and environment it had."""
        state = self.state()
        record = state["processes"][name]
        if self._live(record) is None:
            self._start(state, name, record["argv"], record.get("env"))

    def restart_apiserver(self, timeout: float = 90.0) -> float:
        """Stop kube-apiserver and start it again with the same flags, for resilience tests
        (clients must survive it); returns the seconds until workloads run again.

        /readyz alone is not enough: the controllers' watches come back with a backoff, and
        until they do, the ReplicaSet controller refuses to act on its stale cache. Waiting for
        a probe Deployment keeps the restart from leaking into the tests that follow."""
        state = self.state()
        record = state["processes"]["kube-apiserver"]
        start = time.monotonic()
        self._stop([("kube-apiserver", record)], 10.0)
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
    def _write_pki(self, server: str, net: network.Plan | None, specs: list[NodeSpec]) -> None:
        ca = pki.CertificateAuthority(self.pki_dir)
        service_ip = net.kubernetes_service_ip if net else "10.96.0.1"
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
            ips=(HOST, service_ip, *((net.host_ip,) if net else ())),
        )
        pki.service_account_keys(self.pki_dir)
        # The aggregation layer's identity; without it every component logs errors about the
        # missing requestheader CA, and aggregated API servers could not be tested at all.
        ca.issue("front-proxy-client", "front-proxy-client")
        # The API server's identity towards kubelets (logs, exec, port-forward).
        ca.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        identities = {
            # The admin and kwok act as cluster-admins; the others get their bootstrap roles
            # (kubelets through the Node authorizer).
            "admin": ("ladle-admin", "system:masters"),
            "kwok": ("kwok", "system:masters"),
            "kube-controller-manager": ("system:kube-controller-manager", None),
            "kube-scheduler": ("system:kube-scheduler", None),
        }
        if specs:
            identities["kube-proxy"] = ("system:kube-proxy", None)
        for spec in specs:
            identities[f"kubelet-{spec.name}"] = (f"system:node:{spec.name}", "system:nodes")
            ca.issue(
                spec.name,
                f"system:node:{spec.name}",
                "system:nodes",
                server=True,
                dns_names=(spec.name,),
                ips=(spec.ip,),
            )
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

    def _apiserver_argv(
        self, bins: Path, ports: dict[str, int], net: network.Plan | None
    ) -> list[str]:
        p = self.pki_dir
        address = net.host_ip if net else HOST
        # Without local nodes nothing in-cluster dials the `kubernetes` Service, and the
        # endpoint reconciler refuses a loopback address.
        reconciler = [] if net else ["--endpoint-reconciler-type=none"]
        return [
            str(bins / "kube-apiserver"),
            f"--etcd-servers=http://{HOST}:{ports['etcd']}",
            f"--bind-address={address}",
            f"--advertise-address={address}",
            *reconciler,
            f"--secure-port={ports['kube-apiserver']}",
            f"--cert-dir={p}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--client-ca-file={p / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={p / 'sa.pub'}",
            f"--service-account-signing-key-file={p / 'sa.key'}",
            f"--service-cluster-ip-range={net.service_cidr if net else SERVICE_CIDR}",
            "--allow-privileged=true",
            f"--requestheader-client-ca-file={p / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={p / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={p / 'front-proxy-client.key'}",
            # `kubectl logs`, `exec` and `port-forward` go through the local nodes' kubelets, at
            # the InternalIP each reports, with a serving certificate this CA signed.
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={p / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # A namespace annotated for it puts its pods on the local nodes (node selector and
            # toleration), so tests can run real pods beside kwok's fake ones; kubelets may
            # change only their own Node and its pods.
            "--enable-admission-plugins=NodeRestriction,PodNodeSelector,PodTolerationRestriction",
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

    def _kcm_argv(self, bins: Path, ports: dict[str, int], net: network.Plan | None) -> list[str]:
        return [
            str(bins / "kube-controller-manager"),
            *self._component_common("kube-controller-manager", ports),
            "--controllers=*",
            "--use-service-account-credentials=true",
            f"--root-ca-file={self.pki_dir / 'ca.crt'}",
            f"--service-account-private-key-file={self.pki_dir / 'sa.key'}",
            f"--service-cluster-ip-range={net.service_cidr if net else SERVICE_CIDR}",
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

    def _kube_proxy_argv(self, bins: Path, net: network.Plan, first: NodeSpec) -> list[str]:
        """One kube-proxy for the cluster: every local node shares the cluster's network
        namespace, so one set of rules there serves them all."""
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.pki_dir / "kube-proxy.kubeconfig")},
            "mode": "iptables",
            "clusterCIDR": net.cluster_cidr,
            "hostnameOverride": first.name,
            "bindAddress": first.ip,
            "healthzBindAddress": f"{first.ip}:10256",
            "metricsBindAddress": f"{first.ip}:10249",
            # The namespace's conntrack table is the host's to size; leave it alone.
            "conntrack": {"maxPerCore": 0, "min": 0},
        }
        path = self.state_dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return net.enter([], [str(bins / "kube-proxy"), f"--config={path}"])


def _running(proc: psutil.Process) -> bool:
    try:
        return bool(proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _stop_shims(sockets: list[Path]) -> None:
    """containerd's shims outlive it by design; those of our nodes go once containerd has."""
    addresses = {str(sock) for sock in sockets}
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info.get("name") == "containerd-shim-runc-v2" and addresses & set(cmdline):
            with contextlib.suppress(psutil.Error):
                proc.kill()
