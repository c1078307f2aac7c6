"""The node agent against the session's real cluster, with cheap pods: the operator image
running small Python scripts, so each pod starts in well under a second.

Each behaviour a kubelet owes a pod is checked through the API (status, Events), ``kubectl
logs`` and the processes themselves: addresses, volumes, environment, identity, probes,
restarts, termination, GPUs, and an agent restart.
"""

from __future__ import annotations

import contextlib
import json
import re
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
from ladle.cluster.nodes import GPU_RESOURCE, LOCAL_NODE_LABEL
from ladle.cluster.pytest_plugin import KubeCluster, local_namespace_annotations, wait_until

pytestmark = pytest.mark.cluster

IMAGE = f"ghcr.io/ladle-dev/ladle-operator:{__version__}"
NODE = "ladle-local-0"

# Gathers what a container sees, prints it as one JSON line and serves it on 0.0.0.0:8080;
# becomes ready (an exec probe reads /tmp/ready) a second after that.
INSPECTOR = r"""
import errno, json, os, pathlib, socket, time, http.server, threading

def writable(path):
    try:
        pathlib.Path(path, f".probe-{os.getpid()}").write_text("x")
        return True
    except OSError as err:
        return errno.errorcode[err.errno]

PATHS = ("/", "/etc", "/tmp", "/shared", "/config", "/secret", "/data")
for _ in range(50):
    if os.path.exists("/shared/from-sidecar"):
        break
    time.sleep(0.1)
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")]
from kubernetes import client, config
config.load_incluster_config()
me = client.CoreV1Api().read_namespaced_pod(os.environ["POD_NAME"], os.environ["NAMESPACE"])
server = http.server.HTTPServer(("0.0.0.0", 8080), http.server.SimpleHTTPRequestHandler)
facts = {
    "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "cap_eff": caps[0], "hostname": socket.gethostname(), "cwd": os.getcwd(),
    "argv": __import__("sys").argv[1:],
    "env": {k: os.environ.get(k) for k in (
        "POD_IP", "POD_NAME", "NODE_NAME", "PASSWORD", "GREETING", "CUDA_VISIBLE_DEVICES",
        "KUBERNETES_SERVICE_HOST", "HOME", "PYTHONUNBUFFERED")},
    "hosts": open("/etc/hosts").read(),
    "config": open("/config/greeting").read(),
    "secret": open("/secret/password").read(),
    "pvc": open("/data/hello.txt").read(),
    "sidecar": open("/shared/from-sidecar").read(),
    "token_bytes": len(open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()),
    "writable": {p: writable(p) for p in PATHS},
    "api_node": me.spec.node_name,
    "bound": list(server.server_address),
}
print(json.dumps(facts), flush=True)
time.sleep(1)
pathlib.Path("/tmp/ready").write_text("yes")
server.serve_forever()
"""


def _core(api: ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture(scope="module")
def namespace(k8s_api: ApiClient) -> Iterator[str]:
    name = f"agent-{uuid.uuid4().hex[:6]}"
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
        "metadata": {"name": name},
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


def container_status(pod: dict[str, Any], name: str = "main") -> dict[str, Any]:
    statuses = pod["status"].get("containerStatuses") or []
    return next((s for s in statuses if s["name"] == name), {})


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
    """Wait until a pod's Events show ``what``: the agent posts them in the background, after
    the status that the test has just seen."""

    def shown() -> bool:
        return ok(events(api, namespace, name))

    wait_until(shown, what, 15)


# -- the nodes --------------------------------------------------------------------------------


def test_local_nodes_register_and_keep_leases_like_kubelets(k8s_api: ApiClient) -> None:
    core = _core(k8s_api)
    nodes = core.list_node(label_selector=f"{LOCAL_NODE_LABEL}=true").items
    assert sorted(n.metadata.name for n in nodes) == ["ladle-local-0", "ladle-local-1"]
    for node in nodes:
        labels = node.metadata.labels
        assert "kwok.x-k8s.io/node" not in (node.metadata.annotations or {})
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert labels["nvidia.com/gpu.present"] == "true"
        assert node.status.capacity[GPU_RESOURCE] == "4"
        assert node.status.capacity["cpu"] == "8"
        memory_ki = int(node.status.capacity["memory"].removesuffix("Ki"))
        assert memory_ki * 1024 == pytest.approx(psutil.virtual_memory().total, rel=0.01)
        # Beside kwok's nodes, local ones only take pods that tolerate them.
        assert [(t.key, t.effect) for t in node.spec.taints] == [(LOCAL_NODE_LABEL, "NoSchedule")]
        addresses = {a.type: a.address for a in node.status.addresses}
        assert re.fullmatch(r"127\.\d+\.0\.\d+", addresses["InternalIP"])
        assert node.status.daemon_endpoints.kubelet_endpoint.port == 10250
        assert node.status.node_info.container_runtime_version.startswith("ladle-node-agent://")
        ready = {c.type: c.status for c in node.status.conditions}["Ready"]
        assert ready == "True"
    coordination = client.CoordinationV1Api(k8s_api)
    first = coordination.read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time
    wait_until(
        lambda: coordination.read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time > first,
        "the local node's Lease to be renewed",
        timeout=30,
    )


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
        pod = wait_pod(k8s_api, namespace, name, lambda p: condition(p, "Ready") == "True", "Ready")
        logs = k8s_cluster.run_kubectl("logs", "-n", namespace, name, "-c", "main")
        assert logs.returncode == 0, logs.stderr
        result.append((pod, json.loads(logs.stdout.splitlines()[0])))
    yield result
    for name in names:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    core.delete_namespaced_persistent_volume_claim("data", namespace)
    core.delete_persistent_volume(pv_name)


def test_each_pod_gets_a_loopback_address_and_wildcard_binds_land_on_it(
    k8s_api: ApiClient, inspected: list[tuple[dict[str, Any], dict[str, Any]]]
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
        assert facts["bound"] == [ip, 8080]  # --host 0.0.0.0 ended up on the pod's address
        assert facts["env"]["POD_IP"] == ip
        with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as rsp:
            assert rsp.status == 200
        assert f"{ip}\t{pod['metadata']['name']}" in facts["hosts"]
        assert facts["hostname"] == pod["metadata"]["name"]
    assert len(addresses) == 2  # both listen on port 8080, side by side


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
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
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
    assert facts["token_bytes"] > 100
    assert facts["api_node"] == NODE  # the pod read itself through in-cluster config


def test_security_context_sets_identity_and_drops_capabilities(
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    _, facts = inspected[0]
    assert (facts["uid"], facts["gid"]) == (10001, 10001)
    assert facts["groups"] == [2000, 10001]
    assert facts["cap_eff"] == "0000000000000000"


def test_gpus_come_from_the_node_allocator(
    inspected: list[tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    devices = [facts["env"]["CUDA_VISIBLE_DEVICES"].split(",") for _, facts in inspected]
    assert all(len(d) == 2 for d in devices)
    assert set(devices[0]).isdisjoint(devices[1])
    assert set(devices[0]) | set(devices[1]) == {"0", "1", "2", "3"}


def test_status_and_events_are_what_a_kubelet_reports(
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
    assert main["containerID"].startswith("ladle://")
    assert "startedAt" in main["state"]["running"]
    assert status["startTime"]
    wait_events(
        k8s_api,
        namespace,
        pod["metadata"]["name"],
        lambda seen: (
            ("Created", "Created container: main") in seen
            and ("Started", "Started container main") in seen
            # The exec readiness probe failed until the script wrote /tmp/ready.
            and any(r == "Unhealthy" and "Readiness probe failed" in m for r, m in seen)
        ),
        "Created, Started and Unhealthy (readiness) Events",
    )


def test_kubectl_logs_goes_through_the_kubelet_endpoint(
    k8s_cluster: KubeCluster, namespace: str, inspected: list[tuple[dict[str, Any], dict[str, Any]]]
) -> None:
    name = inspected[0][0]["metadata"]["name"]
    tail = k8s_cluster.run_kubectl("logs", "-n", namespace, name, "-c", "sidecar", "--tail=1")
    assert tail.returncode == 0, tail.stderr
    refused = k8s_cluster.run_kubectl("logs", "-n", namespace, name, "-c", "main", "--timestamps")
    assert refused.returncode != 0
    assert "timestamps is not supported" in refused.stderr


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
        lambda p: (
            (container_status(p).get("state") or {}).get("waiting", {}).get("reason")
            == "CrashLoopBackOff"
        ),
        "in CrashLoopBackOff",
        timeout=30,
    )
    main = container_status(pod)
    assert main["restartCount"] == 2  # the first restart is immediate, the second backs off
    assert main["lastState"]["terminated"]["exitCode"] == 3
    assert main["lastState"]["terminated"]["reason"] == "Error"
    assert "back-off 10s restarting failed container=main" in main["state"]["waiting"]["message"]
    assert pod["status"]["phase"] == "Running"
    previous = k8s_cluster.run_kubectl("logs", "-n", namespace, "crash", "--previous")
    assert previous.stdout.strip() == "crashing", previous.stderr
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
    _core(k8s_api).create_namespaced_pod(
        namespace,
        pod_manifest("unlive", ["sleep", "3600"], container={"livenessProbe": liveness}),
    )
    pod = wait_pod(
        k8s_api,
        namespace,
        "unlive",
        lambda p: container_status(p).get("restartCount", 0) >= 1,
        "restarted",
        timeout=30,
    )
    assert container_status(pod)["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM
    wait_events(
        k8s_api,
        namespace,
        "unlive",
        lambda seen: (
            ("Killing", "Container main failed liveness probe, will be restarted") in seen
            and any(
                r == "Unhealthy" and "Liveness probe failed: dial tcp" in m and "refused" in m
                for r, m in seen
            )
        ),
        "Killing and Unhealthy (liveness, connection refused) Events",
    )


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
    pod = wait_pod(
        k8s_api, namespace, "initialized", lambda p: condition(p, "Ready") == "True", "Ready"
    )
    logs = k8s_cluster.run_kubectl("logs", "-n", namespace, "initialized")
    assert logs.stdout.split() == ["first", "sidecar", "second"], logs.stderr
    inits = {s["name"]: s for s in pod["status"]["initContainerStatuses"]}
    assert inits["first"]["state"]["terminated"]["reason"] == "Completed"
    assert inits["second"]["state"]["terminated"]["exitCode"] == 0
    assert "running" in inits["sidecar"]["state"]
    assert condition(pod, "Initialized") == "True"
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


def test_unknown_image_waits_with_a_clear_reason(k8s_api: ApiClient, namespace: str) -> None:
    manifest = pod_manifest("foreign", ["true"])
    manifest["spec"]["containers"][0]["image"] = "registry.example.com/someone-else:1.0"
    _core(k8s_api).create_namespaced_pod(namespace, manifest)
    pod = wait_pod(
        k8s_api,
        namespace,
        "foreign",
        lambda p: (
            (container_status(p).get("state") or {}).get("waiting", {}).get("reason")
            == "ErrImageNeverPull"
        ),
        "waiting on its image",
        timeout=30,
    )
    message = container_status(pod)["state"]["waiting"]["message"]
    assert "registry.example.com/someone-else:1.0" in message
    assert "runs only ladle's own images" in message
    assert condition(pod, "Ready") == "False"
    assert pod["status"]["phase"] == "Pending"


TRAPPER = r"""
import os, signal, time
log = open("/trace/log", "a", buffering=1)
log.write(f"start {os.getpid()}\n")
signal.signal(signal.SIGTERM, lambda *_: log.write("sigterm\n"))
while True:
    time.sleep(0.2)
"""


def test_deletion_runs_pre_stop_then_sigterm_then_sigkill_then_deletes(
    k8s_api: ApiClient, namespace: str, tmp_path: Path
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
    wait_pod(k8s_api, namespace, "stubborn", lambda p: condition(p, "Ready") == "True", "Ready")
    wait_until((trace / "log").is_file, "the script to start")
    pid = int((trace / "log").read_text().split()[1])
    started = time.monotonic()
    core.delete_namespaced_pod("stubborn", namespace)
    wait_until(
        lambda: not _exists(lambda: core.read_namespaced_pod("stubborn", namespace)),
        "the pod to be deleted",
        timeout=30,
    )
    took = time.monotonic() - started
    assert (trace / "log").read_text().splitlines()[1:] == ["prestop", "sigterm"]
    assert 3 <= took < 8  # the whole grace period, then SIGKILL, then the final delete
    assert not psutil.pid_exists(pid)


def test_agent_restart_adopts_running_pods_and_cleans_up_deleted_ones(
    k8s_cluster: KubeCluster, k8s_api: ApiClient, namespace: str
) -> None:
    core = _core(k8s_api)
    for name in ("keep", "drop"):
        manifest = pod_manifest(
            name,
            python(TRAPPER),
            volumes=[{"name": "trace", "emptyDir": {}}],
            container={"volumeMounts": [{"name": "trace", "mountPath": "/trace"}]},
        )
        core.create_namespaced_pod(namespace, manifest)
    pids = {}
    for name in ("keep", "drop"):
        pod = wait_pod(k8s_api, namespace, name, lambda p: condition(p, "Ready") == "True", "Ready")
        pids[name] = _container_pid(k8s_cluster, pod)
    cluster = k8s_cluster.cluster
    cluster.stop_agent()
    try:
        core.delete_namespaced_pod("drop", namespace, grace_period_seconds=0)
        assert psutil.pid_exists(pids["drop"])  # nobody has stopped it yet
    finally:
        cluster.start_agent()
    wait_until(lambda: not psutil.pid_exists(pids["drop"]), "the deleted pod's process to end")
    keep = read_pod(k8s_api, namespace, "keep")
    assert _container_pid(k8s_cluster, keep) == pids["keep"]
    assert psutil.pid_exists(pids["keep"])
    assert condition(keep, "Ready") == "True"
    assert container_status(keep)["restartCount"] == 0
    # And it is still managed: deleting it now stops it.
    core.delete_namespaced_pod("keep", namespace, grace_period_seconds=1)
    wait_until(lambda: not psutil.pid_exists(pids["keep"]), "the adopted pod's process to end")


def _container_pid(k8s_cluster: KubeCluster, pod: dict[str, Any]) -> int:
    record = (
        k8s_cluster.cluster.agent_dir
        / "pods"
        / pod["metadata"]["uid"]
        / "containers"
        / "main"
        / "record.json"
    )
    with contextlib.suppress(FileNotFoundError):
        return int(json.loads(record.read_text())["pid"])
    return -1
