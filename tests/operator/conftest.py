"""Fixtures for the operator tests.

The object builders return InferenceService, GPUPool and Deployment objects shaped as the API
server returns them, with the CRD's defaults filled in, so that unit tests see exactly what a
reconcile sees. (Fixtures rather than a module: tests run with --import-mode=importlib.)
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kube_harness import Kube, OperatorFactory, OperatorProcess

from ladle.api import API_VERSION
from ladle_dev.pytest_plugin import KubeCluster

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

Builder = Callable[..., dict[str, Any]]


def isvc_object(
    name: str = "chat",
    namespace: str = "team-a",
    *,
    spec: dict[str, Any] | None = None,
    generation: int = 1,
    created: str = "2026-01-01T00:00:00Z",
    status: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "smollm2", "source": {"builtin": {}}},
        "quantization": {"weights": "none", "kvCache": "auto"},
        "runtime": {"startupTimeoutSeconds": 600},
        "engine": {"drainTimeoutSeconds": 30},
        "resources": {"gpus": 1},
        "replicas": 1,
        "minReplicas": 1,
    }
    for key, value in (spec or {}).items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **copy.deepcopy(value)}
        else:
            body[key] = copy.deepcopy(value)
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "generation": generation,
            "creationTimestamp": created,
        },
        "spec": body,
        "status": status or {},
    }


def pool_object(
    name: str = "h200",
    *,
    spec: dict[str, Any] | None = None,
    generation: int = 1,
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "GPUPool",
        "metadata": {"name": name, "uid": f"uid-pool-{name}", "generation": generation},
        "spec": {"nodeSelector": {}, "resourceName": "nvidia.com/gpu", **(spec or {})},
        "status": {},
    }


def deployment_object(
    replicas: int,
    *,
    generation: int = 1,
    observed: int = 1,
    updated: int | None = None,
    ready: int | None = None,
    available: int | None = None,
    total: int | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat-stable", "namespace": "team-a", "generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas if total is None else total,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": replicas if ready is None else ready,
            "availableReplicas": replicas if available is None else available,
            "conditions": conditions or [],
        },
    }


@pytest.fixture
def make_isvc() -> Builder:
    return isvc_object


@pytest.fixture
def make_pool() -> Builder:
    return pool_object


@pytest.fixture
def make_deployment() -> Builder:
    return deployment_object


# ---- cluster fixtures: the chart's RBAC, and the operator as a real process under it --------

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ladle"
SYSTEM_NAMESPACE = "ladle-system"
RELEASE = "ladle"
# The chart names its ServiceAccount after the release's full name ("ladle" for "ladle").
SERVICE_ACCOUNT = "ladle"
TEST_RUNTIME_IMAGE = "registry.test/ladle-runtime:test"
_RUNNING: list[OperatorProcess] = []


def helm(cluster: KubeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cluster.helm), *args],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="session")
def ladle_chart(k8s_cluster: KubeCluster) -> str:
    """The chart installed once per session with no operator replicas: its CRDs, ServiceAccount
    and RBAC are what the operator processes in these tests run under. Returns its namespace."""
    result = helm(
        k8s_cluster,
        "upgrade", "--install", RELEASE, str(CHART),
        "--namespace", SYSTEM_NAMESPACE, "--create-namespace",
        "--set", "replicas=0", "--set", "gateway.replicas=0", "--wait", "--timeout", "120s",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for crd in ("inferenceservices.ladle.dev", "gpupools.ladle.dev"):
        waited = k8s_cluster.run_kubectl(
            "wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s"
        )
        assert waited.returncode == 0, waited.stderr
    return SYSTEM_NAMESPACE


# The chart's Role grants get/update on this one Lease only, so every test operator uses it;
# modules run one after another and a stopping operator hands the Lease over at once.
LEASE = "ladle-operator"


@pytest.fixture(scope="module")
def operator_kubeconfig(
    k8s_cluster: KubeCluster, ladle_chart: str, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A kubeconfig for the chart's ServiceAccount: operators run under exactly its RBAC."""
    folder = tmp_path_factory.mktemp("operator")
    return k8s_cluster.service_account_kubeconfig(
        ladle_chart, SERVICE_ACCOUNT, folder / "operator.kubeconfig"
    )


@pytest.fixture(scope="module")
def operator_factory(operator_kubeconfig: Path, ladle_chart: str) -> Iterator[OperatorFactory]:
    """``start(identity, kubeconfig=None, extra_args=())``: an operator process authenticated
    as the chart's ServiceAccount (or through ``kubeconfig``, a relay's, say)."""
    started: list[OperatorProcess] = []

    def start(
        identity: str, kubeconfig: Path | None = None, extra_args: Sequence[str] = ()
    ) -> OperatorProcess:
        op = OperatorProcess(
            kubeconfig or operator_kubeconfig,
            operator_kubeconfig.parent / f"{identity}.log",
            lease_namespace=ladle_chart,
            lease=LEASE,
            identity=identity,
            extra_args=["--runtime-image", TEST_RUNTIME_IMAGE, *extra_args],
        )
        started.append(op)
        _RUNNING.append(op)
        return op

    yield start
    for op in started:
        if op.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(op.pid, signal.SIGCONT)  # a test may have left it frozen
        with contextlib.suppress(subprocess.TimeoutExpired):
            op.stop()
        if op.proc.poll() is None:
            op.proc.kill()
            op.proc.wait()
        _RUNNING.remove(op)


@pytest.fixture(scope="module")
def operator(operator_factory: OperatorFactory, request: pytest.FixtureRequest) -> OperatorProcess:
    """One leading operator for a whole test module."""
    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    op = operator_factory(f"{name}-0")
    op.wait_leading()
    return op


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test shows what each running operator logged last."""
    report = yield
    if report.failed:
        for op in _RUNNING:
            report.sections.append((f"operator {op.identity} log", op.log_tail()))
    return report


@pytest.fixture(scope="session")
def kube(k8s_cluster: KubeCluster, k8s_api: ApiClient) -> Kube:
    return Kube(k8s_cluster.kubectl, k8s_cluster.env(), k8s_api)


@pytest.fixture(scope="module")
def manual_node(k8s_api: ApiClient, request: pytest.FixtureRequest) -> Iterator[str]:
    """A node with 2 GPUs that kwok leaves alone: tests play its kubelet, writing their pods'
    status. Deleting it at the end lets the pod garbage collector
    remove pods that were left terminating on it."""
    from kube_harness import manual_node as node_manifest
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    name = "manual-" + request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")[:40]
    core.create_node(node_manifest(name, gpus=2))
    yield name
    core.delete_node(name)
