"""The node agent's decisions without a cluster: the image table against the Dockerfiles, pod
spec rules (environment, command line, security), status, allocators and the atomic writer."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from ladle import __version__
from ladle.cluster.agent import images, podspec
from ladle.cluster.agent.allocators import AddressAllocator, Exhausted, GpuAllocator
from ladle.cluster.agent.server import tail_offset
from ladle.cluster.agent.status import ContainerView, phase, pod_status
from ladle.cluster.agent.volumes import write_atomically

ROOT = Path(__file__).resolve().parents[2]


def dockerfile(name: str) -> dict[str, Any]:
    """The final stage's ENTRYPOINT, CMD, USER, WORKDIR and ENV of a Dockerfile."""
    text = (ROOT / name).read_text().replace("\\\n", " ")
    stage: dict[str, Any] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage = {"ENV": {}, "CMD": [], "WORKDIR": "/", "USER": "0:0"}
        elif word in ("ENTRYPOINT", "CMD"):
            stage[word] = json.loads(rest)
        elif word in ("USER", "WORKDIR"):
            stage[word] = rest.strip()
        elif word == "ENV":
            stage["ENV"].update(pair.split("=", 1) for pair in rest.split())
    return stage


@pytest.mark.parametrize("image", images.IMAGES, ids=lambda i: i.repository.rsplit("/", 1)[1])
def test_image_table_matches_its_dockerfile(image: images.Image) -> None:
    assert image.dockerfile is not None
    stage = dockerfile(image.dockerfile)
    assert list(image.entrypoint) == stage["ENTRYPOINT"]
    assert list(image.cmd) == stage["CMD"]
    assert image.user == stage["USER"]
    assert image.workdir == stage["WORKDIR"]
    assert dict(image.env) == stage["ENV"]


def test_baked_model_is_where_the_runtime_converts_it() -> None:
    from ladle.runtime.models.loader import DEFAULT_MODEL_NAME
    from ladle.runtime.quantization import bake

    assert images.DEFAULT_MODEL_NAME == DEFAULT_MODEL_NAME
    runtime = images.resolve(f"ghcr.io/ladle-dev/ladle-runtime:{__version__}")
    assert runtime.env["LADLE_DEFAULT_MODEL_DIR"] == images.DEFAULT_MODEL.path
    assert runtime.env[bake.ENV] == images.BAKED_CALIBRATION.path
    assert images.DEFAULT_MODEL.host_path.name == DEFAULT_MODEL_NAME


@pytest.mark.parametrize(
    ("reference", "reason"),
    [
        ("registry.example.com/ladle-runtime-qwen:0.1.0", "ErrImageNeverPull"),
        ("ghcr.io/ladle-dev/ladle-runtime:9.9.9", "ErrImageNeverPull"),
        ("ghcr.io/ladle-dev/ladle-runtime", "ErrImageNeverPull"),  # :latest
        ("Not An Image!", "InvalidImageName"),
    ],
)
def test_other_images_are_refused_with_the_kubelet_reason(reference: str, reason: str) -> None:
    with pytest.raises(images.ImageError) as caught:
        images.resolve(reference)
    assert caught.value.reason == reason
    if reason == "ErrImageNeverPull":
        assert reference in caught.value.message
        assert f"ghcr.io/ladle-dev/ladle-operator:{__version__}" in caught.value.message


def _pod(**spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u-1",
            "labels": {"app": "x"},
            "generation": 1,
        },
        "spec": {"nodeName": "ladle-local-0", "serviceAccountName": "sa", **spec},
    }


def test_environment_follows_the_kubelet_order_and_expansion() -> None:
    pod = _pod()
    facts = podspec.PodFacts(pod, "127.9.1.2", "127.9.0.1", {"cpu": "8", "memory": "16Gi"})
    secret = {"data": {"token": base64.b64encode(b"s3cret").decode()}}
    container = {
        "name": "c",
        "resources": {"limits": {"memory": "2Gi"}},
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "A", "value": "a"},
            {"name": "B", "value": "$(A)-$(MISSING)-$$(A)"},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {
                "name": "MEM",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}},
            },
        ],
    }
    env = podspec.container_env(
        facts,
        container,
        secrets={"s": secret, "gone": None},
        config_maps={"cm": {"data": {"x": "1"}}},
        service_env={"KUBERNETES_SERVICE_HOST": "127.0.0.1"},
    )
    assert env == {
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "CM_x": "1",
        "A": "a",
        "B": "a-$(MISSING)-$(A)",
        "IP": "127.9.1.2",
        "APP": "x",
        "TOKEN": "s3cret",
        "MEM": "2048",
        "CPU": "8",  # no limit: the node's allocatable
    }
    with pytest.raises(podspec.ContainerConfigError, match='secret "s" not found'):
        podspec.container_env(facts, container, secrets={}, config_maps={"cm": {}}, service_env={})


def test_command_line_follows_docker_rules() -> None:
    image = images.resolve(f"ghcr.io/ladle-dev/ladle-runtime:{__version__}")
    env = {"PORT": "9000"}
    assert podspec.command_line(image, {}, env) == [
        "ladle", "serve", "--host", "0.0.0.0", "--port", "8000",
    ]  # fmt: skip
    assert podspec.command_line(image, {"args": ["--port", "$(PORT)"]}, env) == [
        "ladle", "serve", "--port", "9000",
    ]  # fmt: skip
    # command replaces ENTRYPOINT and drops CMD
    assert podspec.command_line(image, {"command": ["sleep", "1"]}, env) == ["sleep", "1"]


def test_security_context_gives_identity_and_refuses_root_for_run_as_non_root() -> None:
    operator = images.resolve(f"ghcr.io/ladle-dev/ladle-operator:{__version__}")
    pod = _pod(securityContext={"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 2000})
    container = {
        "name": "c",
        "securityContext": {
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]},
        },
    }
    sec = podspec.security(pod, container, operator)
    assert (sec.uid, sec.gid, sec.groups) == (10001, 10001, (2000, 10001))
    assert sec.read_only_root
    assert sec.no_new_privs
    assert sec.capabilities == ("NET_BIND_SERVICE",)
    root = _pod(securityContext={"runAsUser": 0, "runAsNonRoot": True})
    with pytest.raises(podspec.ContainerConfigError, match="runAsNonRoot and image will run"):
        podspec.security(root, {"name": "c"}, operator)


def test_probe_defaults_and_named_ports() -> None:
    probe = podspec.probe({"httpGet": {"path": "/h", "port": "http"}})
    assert probe is not None
    assert (probe.period, probe.timeout, probe.success_threshold, probe.failure_threshold) == (
        10.0,
        1.0,
        1,
        3,
    )
    container = {"ports": [{"name": "http", "containerPort": 8000}]}
    assert podspec.container_port(container, "http") == 8000
    assert podspec.container_port(container, 81) == 81
    with pytest.raises(ValueError, match="named ports"):
        podspec.container_port(container, "metrics")


def test_pod_status_phase_and_conditions() -> None:
    running = ContainerView("c", "img", state={"running": {"startedAt": "t"}}, started=True)
    assert phase([ContainerView("c", "img")]) == "Pending"
    assert phase([running]) == "Running"
    done = {"terminated": {"exitCode": 0}}
    assert phase([ContainerView("c", "img", state=done, final=True)]) == "Succeeded"
    failed = {"terminated": {"exitCode": 2}}
    assert phase([ContainerView("c", "img", state=failed, final=True)]) == "Failed"
    restarting = ContainerView("c", "img", state=failed, restart_count=1)
    assert phase([restarting]) == "Running"

    pod = _pod()
    pod["status"] = {
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "t0"},
            {"type": "Ready", "status": "False", "lastTransitionTime": "t0"},
        ]
    }
    status = pod_status(
        pod,
        [running],
        pod_ip="127.9.1.2",
        host_ip="127.9.0.1",
        start_time="t0",
        sandbox_ready=True,
        now="t1",
    )
    conditions = {c["type"]: c for c in status["conditions"]}
    assert "PodScheduled" not in conditions  # the scheduler's, left alone by the merge patch
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Ready"]["lastTransitionTime"] == "t0"  # unchanged status keeps its time
    assert conditions["Ready"]["message"] == "containers with unready status: [c]"
    assert status["podIPs"] == [{"ip": "127.9.1.2"}]
    assert status["containerStatuses"][0]["state"] == {
        "waiting": None,
        "running": {"startedAt": "t"},
        "terminated": None,
    }


def test_allocators() -> None:
    ips = AddressAllocator("127.9.1.0/30")
    first, second = ips.allocate(), ips.allocate()
    assert {first, second} == {"127.9.1.1", "127.9.1.2"}
    with pytest.raises(Exhausted):
        ips.allocate()
    ips.release(first)
    assert ips.allocate() == first

    gpus = GpuAllocator(4)
    assert gpus.allocate(("pod-a", "c"), 2) == [0, 1]
    assert gpus.allocate(("pod-a", "c"), 2) == [0, 1]  # a restart keeps its devices
    assert gpus.allocate(("pod-b", "c"), 1) == [2]
    with pytest.raises(Exhausted, match="2 GPUs requested but only 1 of 4 are free"):
        gpus.allocate(("pod-c", "c"), 2)
    gpus.release("pod-a")
    assert gpus.allocate(("pod-c", "c"), 2) == [0, 1]
    assert gpus.allocate(("pod-d", "c"), 1) == [3]
    with pytest.raises(Exhausted, match=r"^1 GPU requested but only 0 of 4 are free"):
        gpus.allocate(("pod-e", "c"), 1)


def test_atomic_writer_swaps_the_whole_set(tmp_path: Path) -> None:
    folder = tmp_path / "vol"
    assert write_atomically(folder, {"a": (b"1", 0o644), "dir/b": (b"2", 0o600)}, None)
    assert (folder / "a").read_text() == "1"
    assert (folder / "dir" / "b").read_text() == "2"
    assert os.readlink(folder / "a") == "..data/a"
    old = os.readlink(folder / "..data")
    assert not write_atomically(folder, {"a": (b"1", 0o644), "dir/b": (b"2", 0o600)}, None)
    assert write_atomically(folder, {"a": (b"changed", 0o644)}, None)
    assert (folder / "a").read_text() == "changed"
    assert not (folder / "dir").exists()
    assert not (folder / old).exists()


def test_tail_offset(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_bytes(b"one\ntwo\nthree\n")
    assert log.read_bytes()[tail_offset(log, 2) :] == b"two\nthree\n"
    assert tail_offset(log, 10) == 0
    assert tail_offset(log, 0) == log.stat().st_size
