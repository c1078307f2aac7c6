"""The local nodes against the session's real cluster, with cheap pods: the operator image
running small Python scripts, so each pod starts in about a second.

A local node is a real kubelet with containerd and runc, so these tests check that the pieces
are wired as on a user's node, through the API (status, Events), kubectl (logs, exec,
port-forward) and the processes themselves: addresses and Services, volumes, environment,
identity, GPUs from the device plugin, probes, restarts, the kernel's OOM killer, termination,
and a kubelet restart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ladle import __version__
from ladle_dev.cluster import images
from ladle_dev.cluster.control_plane import NODE_IMAGES
from ladle_dev.cluster.node import LocalNode
from ladle_dev.cluster.nodes import GPU_RESOURCE, LOCAL_NODE_LABEL
from ladle_dev.pytest_plugin import KubeCluster, local_namespace_annotations, wait_until

pytestmark = pytest.mark.cluster

IMAGE = f"ghcr.io/ladle-dev/ladle-operator:{__version__}"
NODE = "ladle-local-0"

# Gathers what a container sees (reading its own pod through the API, as in-cluster clients
# do), prints it as one JSON line and serves HTTP on 0.0.0.0:8080; becomes ready (an exec probe
# reads /tmp/ready) four seconds after that, so that the kubelet's readiness probe (every
# second) fails at least once: with one second, a fast machine's first probe came after it.
INSPECTOR = r"""
import errno, http.server, json, os, pathlib, socket, ssl, time, urllib.request

def writable(path):
    try:
        pathlib.Path(path, f".probe-{os.getpid()}").write_text("x")
        return True
    except OSError as err:
        return errno.errorcode[err.errno]

def read_own_pod():
    account = "/var/run/secrets/kubernetes.io/serviceaccount"
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    url = (f"https://{host}:{port}/api/v1/namespaces/{os.environ['NAMESPACE']}/pods/"
           f"{os.environ['POD_NAME']}")
    token = open(f"{account}/token").read()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    context = ssl.create_default_context(cafile=f"{account}/ca.crt")
    return json.load(urllib.request.urlopen(request, context=context, timeout=10))

PATHS = ("/", "/etc", "/tmp", "/shared", "/config", "/secret", "/data")
for _ in range(50):
    if os.path.exists("/shared/from-sidecar"):
        break
    time.sleep(0.1)
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")]
server = http.server.HTTPServer(("0.0.0.0", 8080), http.server.SimpleHTTPRequestHandler)
facts = {
    "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "cap_eff": caps[0], "hostname": socket.gethostname(), "cwd": os.getcwd(),
    "argv": __import__("sys").argv[1:], "pid": os.getpid(),
    "env": {k: os.environ.get(k) for k in (
        "POD_IP", "POD_NAME", "NODE_NAME", "PASSWORD", "GREETING", "NVIDIA_VISIBLE_DEVICES",
        "KUBERNETES_SERVICE_HOST", "HOME", "PYTHONUNBUFFERED")},
    "hosts": open("/etc/hosts").read(),
    "config": open("/config/greeting").read(),
    "secret": open("/secret/password").read(),
    "pvc": open("/data/hello.txt").read(),
    "sidecar": open("/shared/from-sidecar").read(),
    "writable": {p: writable(p) for p in PATHS},
    "api_node": read_own_pod()["spec"]["nodeName"],
}
print(json.dumps(facts), flush=True)
time.sleep(4)
pathlib.Path("/tmp/ready").write_text("yes")
server.serve_forever()
"""


def _core(api: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture(scope="module")
def namespace(k8s_api: ApiClient, k8s_local_nodes: list[LocalNode]) -> Iterator[str]:
    name = f"nodes-{uuid.uuid4().hex[:6]}"
    meta = client.V1ObjectMeta(name=name, annotations=local_namespace_annotations())
    _core(k8s_api).create_namespace(client.V1Namespace(metadata=meta))
    wait_until(
        lambda: _exists(lambda: _core(k8s_api).read_namespaced_service_account("default", name)),
        "the default ServiceAccount",
    )
    # The inspector reads its own pod through in-cluster config, as the default account.
    client.RbacAuthorizationV1Api(k8s_api).create_namespaced_role_binding(
        name,
        {
            "metadata": {"name": "default-view"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "view",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": name}],
        },
    )
    yield name
    _core(k8s_api).delete_namespace(name)


def _exists(read: Any) -> bool:
    try:
        read()
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return True


def pod_manifest(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": IMAGE, "command": command, **spec.pop("container", {})}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5, **spec},
    }


def python(script: str) -> list[str]:
    return ["python", "-c", script]


def read_pod(api: ApiClient, namespace: str, name: str) -> dict[str, Any]:
    raw: dict[str, Any] = (
        _core(api).read_namespaced_pod(name, namespace, _preload_content=False).json()
    )
    return raw


def condition(pod: dict[str, Any], kind: str) -> str:
    for item in pod["status"].get("conditions") or []:
        if item["type"] == kind:
            return str(item["status"])
    return "Unknown"


def wait_pod(
    api: ApiClient, namespace: str, name: str, check: Any, what: str, timeout: float = 60
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        try:
            pod = read_pod(api, namespace, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return pod if check(pod) else None

    result: dict[str, Any] = wait_until(probe, f"pod {name} {what}", timeout)
    return result


def ready(api: ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return wait_pod(api, namespace, name, lambda p: condition(p, "Ready") == "True", "Ready")


def container_status(pod: dict[str, Any], name: str = "main") -> dict[str, Any]:
    statuses = pod["status"].get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == name), {})


def ready_or_running(pod: dict[str, Any]) -> bool:
    return "running" in (container_status(pod).get("state") or {})


def waiting_reason(pod: dict[str, Any]) -> str | None:
    return (container_status(pod).get("state") or {}).get("waiting", {}).get("reason")


def events(api: ApiClient, namespace: str, name: str) -> list[tuple[str, str]]:
    items = (
        _core(api)
        .list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
        .items
    )
    return [(e.reason, e.message) for e in items]


def wait_events(
    api: ApiClient,
    namespace: str,
    name: str,
    ok: Callable[[list[tuple[str, str]]], bool],
    what: str,
) -> None:
    """Wait until a pod's Events show ``what``: the kubelet posts them asynchronously, after
    the status that the test has just seen."""

    seen: list[tuple[str, str]] = []

    def shown() -> bool:
        seen[:] = events(api, namespace, name)
        return ok(seen)

    try:
        wait_until(shown, what, 60)
    except TimeoutError as err:
        raise TimeoutError(f"{err}; the pod's Events were {seen}") from err


# -- the nodes --------------------------------------------------------------------------------


def test_local_nodes_are_kubelets_on_containerd_with_the_machines_resources(
    k8s_cluster: KubeCluster, k8s_api: ApiClient, k8s_local_nodes: list[LocalNode]
) -> None:
    core = _core(k8s_api)
    nodes = core.list_node(label_selector=f"{LOCAL_NODE_LABEL}=true").items
    assert sorted(n.metadata.name for n in nodes) == ["ladle-local-0", "ladle-local-1"]
    plan = k8s_cluster.cluster.network_plan()
    assert plan is not None
    for node, local in zip(
        sorted(nodes, key=lambda n: n.metadata.name), k8s_local_nodes, strict=True
    ):
        labels = node.metadata.labels
        assert "kwok.x-k8s.io/node" not in (node.metadata.annotations or {})
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert labels["nvidia.com/gpu.present"] == "true"
        # What the kubelet measured: this machine's CPUs and memory; GPUs from the plugin.
        assert node.status.capacity["cpu"] == str(os.cpu_count())
        memory_ki = int(node.status.capacity["memory"].removesuffix("Ki"))
        assert memory_ki * 1024 == pytest.approx(psutil.virtual_memory().total, rel=0.01)
        assert node.status.capacity[GPU_RESOURCE] == "4"
        # Beside kwok's nodes, local ones only take pods that tolerate them.
        assert [(t.key, t.effect) for t in node.spec.taints] == [(LOCAL_NODE_LABEL, "NoSchedule")]
        addresses = {a.type: a.address for a in node.status.addresses}
        assert addresses["InternalIP"] == local.spec.ip == plan.node_ip(local.spec.index)
        assert node.spec.pod_cidr == plan.pod_cidr(local.spec.index)
        assert node.status.daemon_endpoints.kubelet_endpoint.port == 10250
        assert node.status.node_info.kubelet_version == "v1.37.2"
        assert node.status.node_info.container_runtime_version.startswith("containerd://2.")
        ready_now = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready_now == "True"
    coordination = client.CoordinationV1Api(k8s_api)
    wait_until(
        lambda: _exists(lambda: coordination.read_namespaced_lease(NODE, "kube-node-lease")),
        "the local node's Lease",
        timeout=30,
    )
    first = coordination.read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time
    wait_until(
        lambda: coordination.read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time > first,
        "the local node's Lease to be renewed",
        timeout=30,
    )


def test_the_nodes_run_the_images_built_from_the_dockerfiles(
    k8s_local_nodes: list[LocalNode],
) -> None:
    """What each node's containerd holds is what buildah built: same image ids, and the
    Dockerfiles' users, entry points and OCI labels."""
    runtime = images.inspect(images.RUNTIME.reference)
    operator = images.inspect(images.OPERATOR.reference)
    assert runtime is not None
    assert operator is not None
    for info, entrypoint in ((runtime, ["ladle", "serve"]), (operator, ["ladle", "operator"])):
        config = info["OCIv1"]["config"]  # type: ignore[index]
        assert config["User"] == "10001:10001"
        assert config["Entrypoint"] == entrypoint
        labels = config["Labels"]
        assert labels["org.opencontainers.image.version"] == __version__
        assert labels["org.opencontainers.image.revision"] == images.revision()
    for node in k8s_local_nodes:
        listed = subprocess.run(
            [str(_crictl()), "--runtime-endpoint", node.endpoint, "images", "-o", "json"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        held = {
            tag: image["id"]
            for image in json.loads(listed.stdout)["images"]
            for tag in image["repoTags"]
        }
        for reference in (images.RUNTIME.reference, images.OPERATOR.reference, images.PAUSE):
            assert held[reference] == f"sha256:{images.image_id(reference)}", node.spec.name
        # The layers were not copied in: the node's content store holds the layout's files.
        for digest, path in images.image_blobs(images.RUNTIME.reference).layers:
            algorithm, _, hexdigest = digest.partition(":")
            assert (node.content_blobs / algorithm / hexdigest).samefile(path), (
                node.spec.name,
                digest,
            )


def test_up_refuses_more_local_nodes_than_the_disk_holds(
    k8s_local_nodes: list[LocalNode], tmp_path: Path
) -> None:
    """Each node unpacks the images for itself: asked for more nodes than the disk holds,
    ``ladle cluster up`` says so in one line and starts nothing."""
    per_node = sum(images.unpacked_size(ref) for ref in NODE_IMAGES)
    count = shutil.disk_usage(tmp_path).free // per_node + 3
    state_dir = tmp_path / "big"
    up = subprocess.run(
        [sys.executable, "-m", "ladle.cli", "cluster", "up", "--state-dir", str(state_dir),
         "--nodes", "0", "--local-nodes", str(count)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert up.returncode == 1, up.stdout + up.stderr
    line = up.stderr.strip()
    assert "\n" not in line, line
    assert f"{count} local nodes need about" in line, line
    assert "GiB is: free some space, or start fewer local nodes (--local-nodes)" in line, line
    assert not state_dir.exists()


def _crictl() -> Path:
    from ladle_dev.cluster import build

    return build.bin_dir() / "crictl"


# -- what a container sees ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def inspected(
    k8s_cluster: KubeCluster,
    k8s_api: ApiClient,
    namespace: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Two inspector pods on one node: (pod, facts) each."""
    core = _core(k8s_api)
    data = tmp_path_factory.mktemp("pv")
    data.chmod(0o755)  # pytest makes it 0700; the pods run as 10001
    (data / "hello.txt").write_text("from the volume")
    pv_name = f"{namespace}-data"
    core.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": str(data), "type": "Directory"},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "data"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cfg"}, "data": {"greeting": "hello"}}
    )
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "pw"}, "stringData": {"password": "s3cret"}}
    )
    field = lambda path: {"valueFrom": {"fieldRef": {"fieldPath": path}}}  # noqa: E731
    names = ["inspect-a", "inspect-b"]
    for name in names:
        manifest = pod_manifest(
            name,
            python(INSPECTOR),
            nodeSelector={"kubernetes.io/hostname": NODE},
            securityContext={"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 2000},
            volumes=[
                {"name": "shared", "emptyDir": {}},
                {"name": "tmp", "emptyDir": {"medium": "Memory"}},
                {"name": "config", "configMap": {"name": "cfg"}},
                {"name": "secret", "secret": {"secretName": "pw"}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}},
            ],
            container={
                "args": ["$(GREETING)", "$(POD_IP)"],
                "workingDir": "/tmp",
                "env": [
                    {"name": "POD_IP", **field("status.podIP")},
                    {"name": "POD_NAME", **field("metadata.name")},
                    {"name": "NAMESPACE", **field("metadata.namespace")},
                    {"name": "NODE_NAME", **field("spec.nodeName")},
                    {
                        "name": "GREETING",
                        "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}},
                    },
                    {
                        "name": "PASSWORD",
                        "valueFrom": {"secretKeyRef": {"name": "pw", "key": "password"}},
                    },
                ],
                "ports": [{"name": "http", "containerPort": 8080}],
                "resources": {"limits": {GPU_RESOURCE: "2"}},
                "readinessProbe": {"exec": {"command": ["cat", "/tmp/ready"]}, "periodSeconds": 1},
                "securityContext": {
                    "readOnlyRootFilesystem": True,
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [
                    {"name": "shared", "mountPath": "/shared"},
                    {"name": "tmp", "mountPath": "/tmp"},
                    {"name": "config", "mountPath": "/config"},
                    {"name": "secret", "mountPath": "/secret"},
                    {"name": "data", "mountPath": "/data"},
                ],
            },
        )
        manifest["metadata"]["labels"] = {"app": "inspect"}
        manifest["spec"]["containers"].append(
            {
                "name": "sidecar",
                "image": IMAGE,
                "command": ["sh", "-c", "echo sidecar > /shared/from-sidecar && exec sleep 3600"],
                "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
            }
        )
        core.create_namespaced_pod(namespace, manifest)
    result = []
    for name in names:
        pod = ready(k8s_api, namespace, name)
        logs = k8s_cluster.run_kubectl("logs", "-n", namespace, name, "-c", "main")
        assert logs.returncode == 0, logs.stderr
        result.append((pod, json.loads(logs.stdout.splitlines()[0])))
    yield result
    for name in names:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    core.delete_namespaced_persistent_volume_claim("data", namespace)
    core.delete_persistent_volume(pv_name)


def test_each_pod_has_its_own_network_namespace_and_address(
    k8s_cluster: KubeCluster,
    k8s_api: ApiClient,
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    node = _core(k8s_api).read_node(NODE)
    node_ip = {a.type: a.address for a in node.status.addresses}["InternalIP"]
    prefix = node.spec.pod_cidr.removesuffix("0/24")
    addresses = set()
    for pod, facts in inspected:
        ip = pod["status"]["podIP"]
        addresses.add(ip)
        assert ip.startswith(prefix)
        assert pod["status"]["podIPs"] == [{"ip": ip}]
        assert pod["status"]["hostIP"] == node_ip
        assert facts["env"]["POD_IP"] == ip
        # Both serve 0.0.0.0:8080 in namespaces of their own; the host reaches each by route.
        with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as rsp:
            assert rsp.status == 200
        assert f"{ip}\t{pod['metadata']['name']}" in facts["hosts"]
        assert facts["hostname"] == pod["metadata"]["name"]
        assert facts["pid"] == 1  # a PID namespace of its own (the sandbox is not shared)
        host_pid = k8s_cluster.container_pid(pod, "main")
        assert psutil.Process(host_pid).cmdline()[:2] == ["python", "-c"]
    assert len(addresses) == 2


def test_services_route_through_kube_proxy(
    k8s_cluster: KubeCluster,
    k8s_api: ApiClient,
    namespace: str,
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    """A ClusterIP answers from the host and from a pod: kube-proxy's rules in the cluster's
    network namespace send it to the inspectors."""
    service = _core(k8s_api).create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "inspect"},
            "spec": {"selector": {"app": "inspect"}, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    cluster_ip = service.spec.cluster_ip
    plan = k8s_cluster.cluster.network_plan()
    assert plan is not None
    assert cluster_ip.startswith(f"10.{plan.block}.")

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://{cluster_ip}/", timeout=3) as rsp:
                return bool(rsp.status == 200)
        except OSError:
            return False

    wait_until(answers, f"Service {cluster_ip} to answer from the host", timeout=30)
    name = inspected[0][0]["metadata"]["name"]
    script = f"import urllib.request; print(urllib.request.urlopen('http://{cluster_ip}/').status)"
    fetched = k8s_cluster.run_kubectl(
        "exec", "-n", namespace, name, "-c", "main", "--", "python", "-c", script
    )
    assert (fetched.returncode, fetched.stdout.strip()) == (0, "200"), fetched.stderr


def test_environment_command_and_working_directory(
    inspected: list[tuple[dict[str, Any], dict[str, Any]]], k8s_cluster: KubeCluster
) -> None:
    pod, facts = inspected[0]
    env = facts["env"]
    assert env["POD_NAME"] == pod["metadata"]["name"]
    assert env["NODE_NAME"] == NODE
    assert env["PASSWORD"] == "s3cret"
    assert env["GREETING"] == "hello"
    assert env["PYTHONUNBUFFERED"] == "1"  # the image's ENV
    plan = k8s_cluster.cluster.network_plan()
    assert plan is not None
    assert env["KUBERNETES_SERVICE_HOST"] == plan.kubernetes_service_ip
    assert facts["argv"] == ["hello", pod["status"]["podIP"]]  # $(VAR) expanded
    assert facts["cwd"] == "/tmp"


def test_volumes_appear_at_their_paths_and_read_only_is_honoured(
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    _, facts = inspected[0]
    assert facts["config"] == "hello"
    assert facts["secret"] == "s3cret"
    assert facts["pvc"] == "from the volume"
    assert facts["sidecar"] == "sidecar\n"  # one emptyDir, two containers
    assert facts["writable"] == {
        "/": "EROFS",  # readOnlyRootFilesystem
        "/etc": "EROFS",
        "/tmp": True,  # emptyDir, medium Memory
        "/shared": True,
        "/config": "EROFS",  # ConfigMaps and Secrets are always read-only
        "/secret": "EROFS",
        "/data": "EROFS",  # the claim is mounted readOnly
    }


def test_service_account_token_gives_in_cluster_login(
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    _, facts = inspected[0]
    assert facts["api_node"] == NODE  # the pod read itself through the kubernetes Service


def test_security_context_sets_identity_and_drops_capabilities(
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    _, facts = inspected[0]
    assert (facts["uid"], facts["gid"]) == (10001, 10001)
    assert 2000 in facts["groups"]  # fsGroup
    assert facts["cap_eff"] == "0000000000000000"


def test_gpus_come_from_the_device_plugin(
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    """The kubelet hands out the plugin's devices, two each, never the same one twice; the
    plugin answers as NVIDIA's does, with NVIDIA_VISIBLE_DEVICES."""
    devices = [facts["env"]["NVIDIA_VISIBLE_DEVICES"].split(",") for _, facts in inspected]
    assert all(len(d) == 2 for d in devices)
    assert all(d.startswith("GPU-") for pod in devices for d in pod)
    assert set(devices[0]).isdisjoint(devices[1])


def test_status_and_events_are_the_kubelets(
    k8s_api: ApiClient, namespace: str, inspected: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    pod, _ = inspected[0]
    status = pod["status"]
    assert status["phase"] == "Running"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "PodScheduled": "True",
        "PodReadyToStartContainers": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    main = container_status(pod)
    assert main["ready"]
    assert main["started"]
    assert main["restartCount"] == 0
    assert main["image"] == IMAGE
    assert main["containerID"].startswith("containerd://")
    assert "startedAt" in main["state"]["running"]
    wait_events(
        k8s_api,
        namespace,
        pod["metadata"]["name"],
        lambda seen: (
            any(r == "Pulled" and "already present on machine" in m for r, m in seen)
            and any(r == "Started" for r, _ in seen)
            # The exec readiness probe failed until the script wrote /tmp/ready (or, on a loaded
            # machine, errored: the kubelet says "errored" when the exec itself did not run).
            and any(
                r == "Unhealthy" and re.match("Readiness probe (failed|errored)", m)
                for r, m in seen
            )
        ),
        "Pulled (already present), Started and Unhealthy (readiness) Events",
    )


def test_kubectl_logs_exec_and_port_forward_go_through_the_kubelet(
    k8s_cluster: KubeCluster, namespace: str, inspected: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    name = inspected[0][0]["metadata"]["name"]
    logs = k8s_cluster.run_kubectl("logs", "-n", namespace, name, "-c", "main", "--timestamps")
    assert logs.returncode == 0, logs.stderr
    stamp, line = logs.stdout.splitlines()[0].split(" ", 1)
    assert stamp.endswith("Z")
    assert json.loads(line)["env"]["POD_NAME"] == name
    exec_ = k8s_cluster.run_kubectl(
        "exec", "-n", namespace, name, "-c", "sidecar", "--", "id", "-u"
    )
    assert (exec_.returncode, exec_.stdout.strip()) == (0, "10001"), exec_.stderr
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    forward = subprocess.Popen(
        [str(k8s_cluster.kubectl), "port-forward", "-n", namespace, f"pod/{name}", f"{port}:8080"],
        env=k8s_cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:

        def forwarded() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=3) as rsp:
                    return bool(rsp.status == 200)
            except OSError:
                return False

        wait_until(forwarded, "kubectl port-forward to answer", timeout=30)
    finally:
        forward.terminate()
        forward.wait(10)


# -- lifecycle ----------------------------------------------------------------------------------


def test_crash_loop_restarts_with_back_off_and_keeps_the_last_state(
    k8s_cluster: KubeCluster, k8s_api: ApiClient, namespace: str
) -> None:
    _core(k8s_api).create_namespaced_pod(
        namespace, pod_manifest("crash", python("print('crashing', flush=True); exit(3)"))
    )
    pod = wait_pod(
        k8s_api,
        namespace,
        "crash",
        lambda p: container_status(p).get("restartCount", 0) >= 1 and not ready_or_running(p),
        "backing off after a restart",
        timeout=60,
    )
    main = container_status(pod)
    assert main["lastState"]["terminated"]["exitCode"] == 3
    assert main["lastState"]["terminated"]["reason"] == "Error"
    # While it backs off, a 1.37 kubelet shows the run that ended, not a waiting state.
    assert main["state"]["terminated"]["exitCode"] == 3
    assert pod["status"]["phase"] == "Running"
    # The run it backs off from is the one `kubectl logs` shows (the one before it is gone:
    # the kubelet keeps one dead container per container).
    ended = k8s_cluster.run_kubectl("logs", "-n", namespace, "crash")
    assert ended.stdout.strip() == "crashing", ended.stderr
    wait_events(
        k8s_api,
        namespace,
        "crash",
        lambda seen: any(r == "BackOff" for r, _ in seen),
        "a BackOff Event",
    )


def test_liveness_failure_kills_and_restarts_the_container(
    k8s_api: ApiClient, namespace: str
) -> None:
    liveness = {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 2}
    graceful = "import signal, time; signal.signal(signal.SIGTERM, lambda *_: exit(143)); "
    _core(k8s_api).create_namespaced_pod(
        namespace,
        pod_manifest(
            "unlive", python(graceful + "time.sleep(3600)"), container={"livenessProbe": liveness}
        ),
    )
    pod = wait_pod(
        k8s_api,
        namespace,
        "unlive",
        lambda p: container_status(p).get("restartCount", 0) >= 1,
        "restarted",
        timeout=60,
    )
    assert container_status(pod)["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM
    wait_events(
        k8s_api,
        namespace,
        "unlive",
        lambda seen: (
            any(r == "Killing" and "failed liveness probe" in m for r, m in seen)
            and any(r == "Unhealthy" and "Liveness probe failed" in m for r, m in seen)
        ),
        "Killing and Unhealthy (liveness) Events",
    )


def test_the_kernel_oom_kills_a_container_over_its_memory_limit(
    k8s_api: ApiClient, namespace: str
) -> None:
    """Limits are cgroup limits now: 200 MB in a 64 MiB container is the kernel's business."""
    hog = "x = bytearray(200 * 2**20); import time; time.sleep(60)"
    _core(k8s_api).create_namespaced_pod(
        namespace,
        pod_manifest(
            "hog",
            python(hog),
            restartPolicy="Never",
            container={"resources": {"limits": {"memory": "64Mi"}}},
        ),
    )
    pod = wait_pod(
        k8s_api,
        namespace,
        "hog",
        lambda p: p["status"].get("phase") == "Failed",
        "Failed",
        timeout=60,
    )
    terminated = container_status(pod)["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("OOMKilled", 137)


def test_restart_policy_never_ends_in_a_terminal_phase(k8s_api: ApiClient, namespace: str) -> None:
    for name, code in (("done-ok", 0), ("done-bad", 1)):
        _core(k8s_api).create_namespaced_pod(
            namespace, pod_manifest(name, python(f"exit({code})"), restartPolicy="Never")
        )
    ok = wait_pod(
        k8s_api,
        namespace,
        "done-ok",
        lambda p: p["status"].get("phase") == "Succeeded",
        "Succeeded",
    )
    bad = wait_pod(
        k8s_api, namespace, "done-bad", lambda p: p["status"].get("phase") == "Failed", "Failed"
    )
    assert container_status(ok)["state"]["terminated"]["reason"] == "Completed"
    assert container_status(bad)["state"]["terminated"]["exitCode"] == 1
    assert container_status(bad)["restartCount"] == 0


def test_init_containers_run_in_order_before_the_app_and_a_sidecar_keeps_running(
    k8s_cluster: KubeCluster, k8s_api: ApiClient, namespace: str
) -> None:
    work = {"name": "work", "mountPath": "/work"}
    manifest = pod_manifest(
        "initialized",
        ["sh", "-c", "cat /work/steps; exec sleep 3600"],
        volumes=[{"name": "work", "emptyDir": {}}],
        container={"volumeMounts": [work]},
    )
    manifest["spec"]["initContainers"] = [
        {"name": "first", "image": IMAGE, "command": ["sh", "-c", "echo first >> /work/steps"],
         "volumeMounts": [work]},
        {"name": "sidecar", "image": IMAGE, "restartPolicy": "Always",
         "command": ["sh", "-c", "echo sidecar >> /work/steps; exec sleep 3600"],
         "volumeMounts": [work]},
        {"name": "second", "image": IMAGE, "command": ["sh", "-c", "echo second >> /work/steps"],
         "volumeMounts": [work]},
    ]  # fmt: skip
    failing = pod_manifest("uninitialized", ["true"], restartPolicy="Never")
    failing["spec"]["initContainers"] = [{"name": "setup", "image": IMAGE, "command": ["false"]}]
    core = _core(k8s_api)
    core.create_namespaced_pod(namespace, manifest)
    core.create_namespaced_pod(namespace, failing)
    pod = ready(k8s_api, namespace, "initialized")
    logs = k8s_cluster.run_kubectl("logs", "-n", namespace, "initialized")
    assert logs.stdout.split() == ["first", "sidecar", "second"], logs.stderr
    inits = {s["name"]: s for s in pod["status"]["initContainerStatuses"]}
    assert inits["first"]["state"]["terminated"]["reason"] == "Completed"
    assert inits["second"]["state"]["terminated"]["exitCode"] == 0
    assert "running" in inits["sidecar"]["state"]
    assert condition(pod, "Initialized") == "True"
    # The emptyDir is a folder of the node's, under the kubelet's root in the node's view.
    assert (k8s_cluster.empty_dir(pod, "work") / "steps").read_text().split() == [
        "first",
        "sidecar",
        "second",
    ]
    failed = wait_pod(
        k8s_api,
        namespace,
        "uninitialized",
        lambda p: p["status"].get("phase") == "Failed",
        "Failed",
    )
    assert condition(failed, "Initialized") == "False"
    assert failed["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 1
    assert "running" not in container_status(failed).get("state", {})  # the app never started


def test_an_image_no_registry_serves_waits_with_the_pull_error(
    k8s_api: ApiClient, namespace: str
) -> None:
    """Only imported images run: a pull of anything else fails (no registry is reachable from
    the cluster's network), and the pod waits in ErrImagePull or ImagePullBackOff."""
    manifest = pod_manifest("foreign", ["true"])
    manifest["spec"]["containers"][0]["image"] = "registry.example.com/someone-else:1.0"
    _core(k8s_api).create_namespaced_pod(namespace, manifest)
    pod = wait_pod(
        k8s_api,
        namespace,
        "foreign",
        lambda p: waiting_reason(p) in ("ErrImagePull", "ImagePullBackOff"),
        "waiting on its image",
        timeout=60,
    )
    message = container_status(pod)["state"]["waiting"]["message"]
    assert "registry.example.com/someone-else:1.0" in message
    assert condition(pod, "Ready") == "False"
    assert pod["status"]["phase"] == "Pending"


TRAPPER = r"""
import signal, time
log = open("/trace/log", "a", buffering=1)
log.write("start\n")
signal.signal(signal.SIGTERM, lambda *_: log.write("sigterm\n"))
while True:
    time.sleep(0.2)
"""


def test_deletion_runs_pre_stop_then_sigterm_then_sigkill_then_deletes(
    k8s_cluster: KubeCluster, k8s_api: ApiClient, namespace: str, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    trace.chmod(0o777)
    manifest = pod_manifest(
        "stubborn",
        python(TRAPPER),
        terminationGracePeriodSeconds=3,
        volumes=[{"name": "trace", "hostPath": {"path": str(trace)}}],
        container={
            "volumeMounts": [{"name": "trace", "mountPath": "/trace"}],
            "lifecycle": {
                "preStop": {"exec": {"command": ["sh", "-c", "echo prestop >> /trace/log"]}}
            },
        },
    )
    core = _core(k8s_api)
    core.create_namespaced_pod(namespace, manifest)
    pod = ready(k8s_api, namespace, "stubborn")
    wait_until((trace / "log").is_file, "the script to start")
    pid = k8s_cluster.container_pid(pod, "main")
    started = time.monotonic()
    core.delete_namespaced_pod("stubborn", namespace)
    wait_until(
        lambda: not _exists(lambda: core.read_namespaced_pod("stubborn", namespace)),
        "the pod to be deleted",
        timeout=60,
    )
    assert time.monotonic() - started >= 3  # it ignored SIGTERM: the whole grace period
    assert (trace / "log").read_text().splitlines() == ["start", "prestop", "sigterm"]
    assert not psutil.pid_exists(pid)


def test_a_kubelet_restart_keeps_running_pods_and_removes_deleted_ones(
    k8s_cluster: KubeCluster, k8s_api: ApiClient, namespace: str
) -> None:
    core = _core(k8s_api)
    for name in ("keep", "drop"):
        manifest = pod_manifest(
            name, ["sleep", "3600"], nodeSelector={"kubernetes.io/hostname": NODE}
        )
        core.create_namespaced_pod(namespace, manifest)
    pids = {}
    for name in ("keep", "drop"):
        pids[name] = k8s_cluster.container_pid(ready(k8s_api, namespace, name), "main")
    cluster = k8s_cluster.cluster
    kubelet = f"kubelet-{NODE}"
    cluster.stop_component(kubelet)
    try:
        core.delete_namespaced_pod("drop", namespace, grace_period_seconds=0)
        assert psutil.pid_exists(pids["drop"])  # nobody has stopped it yet
    finally:
        cluster.start_component(kubelet)
    wait_until(lambda: not psutil.pid_exists(pids["drop"]), "the deleted pod's process to end", 90)
    keep = read_pod(k8s_api, namespace, "keep")
    assert k8s_cluster.container_pid(keep, "main") == pids["keep"]
    assert condition(keep, "Ready") == "True"
    assert container_status(keep)["restartCount"] == 0
    # The device plugin registered with the new kubelet: the node offers its GPUs again.
    wait_until(
        lambda: _core(k8s_api).read_node(NODE).status.allocatable.get(GPU_RESOURCE) == "4",
        "the GPUs to be offered again",
        timeout=60,
    )
    # And the pod is still managed: deleting it now stops it.
    core.delete_namespaced_pod("keep", namespace, grace_period_seconds=1)
    wait_until(lambda: not psutil.pid_exists(pids["keep"]), "the kept pod's process to end", 60)
