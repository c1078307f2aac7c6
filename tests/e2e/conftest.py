"""Fixtures shared by every end-to-end test module in this package (``tests/e2e/``).

The package (it has an ``__init__.py``, so ``scope="package"`` ends with it) shares one Helm
install of the chart, whose operator and gateway run as pods on the local nodes (real
kubelets, Ladle's own images), and one namespace whose pods all run there. Other test packages
never see this operator: it is uninstalled before they run, so their own operator processes
reconcile alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from kubernetes import client
from kubernetes.client import ApiClient

from ladle_dev.cluster import gaie, jaeger
from ladle_dev.cluster.jaeger import Jaeger
from ladle_dev.cluster.node import LocalNode
from ladle_dev.pytest_plugin import KubeCluster, local_namespace_annotations, wait_until

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ladle"
EXAMPLES = ROOT / "examples"
RELEASE = "ladle-e2e"
SELECTOR = "ladle.dev/inferenceservice"


@dataclass(frozen=True)
class System:
    """The chart's operator running as pods, and a namespace for InferenceServices."""

    cluster: KubeCluster
    api: ApiClient
    system_namespace: str
    namespace: str

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return self.cluster.run_kubectl(*args, stdin=stdin)

    def apply(self, documents: list[dict[str, Any]]) -> None:
        text = yaml.safe_dump_all(documents)
        result = self.kubectl("apply", "-n", self.namespace, "-f", "-", stdin=text)
        assert result.returncode == 0, result.stderr

    def pods(self, isvc: str) -> list[dict[str, Any]]:
        result = self.kubectl(
            "get", "pods", "-n", self.namespace, "-l", f"{SELECTOR}={isvc}", "-o", "json"
        )
        assert result.returncode == 0, result.stderr
        items: list[dict[str, Any]] = json.loads(result.stdout)["items"]
        return items

    def ready_pod(self, isvc: str, timeout: float = 240) -> dict[str, Any]:
        """The Ready, not terminating pod of ``isvc``."""

        def find() -> dict[str, Any] | None:
            for pod in self.pods(isvc):
                if pod["metadata"].get("deletionTimestamp"):
                    continue
                if self.condition(pod, "Ready") == "True":
                    return pod
            return None

        pod: dict[str, Any] = wait_until(find, f"a Ready pod of {isvc}", timeout)
        return pod

    def isvc(self, name: str) -> dict[str, Any]:
        result = self.kubectl(
            "get", "lisvc", "-n", self.namespace, name, "-o", "json", "--show-managed-fields"
        )
        assert result.returncode == 0, result.stderr
        obj: dict[str, Any] = json.loads(result.stdout)
        return obj

    @staticmethod
    def condition(obj: dict[str, Any], kind: str) -> str:
        """The status of condition ``kind`` ("True", "False", or "Unknown" when absent)."""
        for item in (obj.get("status") or {}).get("conditions") or []:
            if item["type"] == kind:
                return str(item["status"])
        return "Unknown"

    @staticmethod
    def example(name: str) -> list[dict[str, Any]]:
        """The documents of ``examples/<name>``."""
        return [doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text()) if doc]

    def container_pid(self, pod: dict[str, Any], container: str = "runtime") -> int:
        """The host's pid of a container's first process (from its node's CRI)."""
        return self.cluster.container_pid(pod, container)


def cpu_service(name: str, model: str, **spec: Any) -> dict[str, Any]:
    """An InferenceService of one CPU replica of the embedded model; ``spec`` adds fields.

    It asks for a CPU, as every runtime pod should: without a request the kubelet gives a pod
    the smallest CPU share (2 against the chart's pods' 102-256), and under load its engine
    starves."""
    return {
        "apiVersion": "ladle.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": model},
            "resources": {"gpus": 0, "cpu": "250m"},
            "replicas": 1,
            **spec,
        },
    }


@pytest.fixture(scope="module")
def plain(default_model: Path) -> Any:
    """The default model in this process, as ``ladle serve`` runs it by default: the answers
    that pods with other engine settings must give."""
    from ladle.runtime import LLM

    return LLM(str(default_model), kv_cache_memory="256Mi", max_model_len=1024)


def greedy(llm: Any, prompt: str, max_tokens: int) -> str:
    from ladle.runtime import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return str(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text)


def _namespace(api: ApiClient, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    meta = client.V1ObjectMeta(name=name, annotations=local_namespace_annotations())
    client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=meta))
    return name


_SYSTEM_KEY = pytest.StashKey[System]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed end-to-end test shows its pods, their Events and the tail of each one's log."""
    report = yield
    system = item.config.stash.get(_SYSTEM_KEY, None)
    if report.failed and system is not None:
        for namespace in (system.namespace, system.system_namespace):
            pods = system.kubectl("get", "pods", "-n", namespace, "-o", "wide")
            events = system.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp")
            report.sections.append((f"pods in {namespace}", pods.stdout + events.stdout[-6000:]))
            names = system.kubectl("get", "pods", "-n", namespace, "-o", "name").stdout.split()
            for name in names:
                logs = system.kubectl("logs", "-n", namespace, name, "--tail=15")
                report.sections.append((f"{name} log", logs.stdout + logs.stderr))
    return report


@pytest.fixture(scope="package")
def default_model() -> Path:
    """The default model converted on this machine (once; the host's cache), for a volume
    that serves it as a user's model."""
    from ladle.runtime.models.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="package")
def collector(
    k8s_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Jaeger]:
    """Jaeger on the host, taking OTLP at the cluster's host address, where pods reach it."""
    host = urlsplit(k8s_cluster.server).hostname
    assert host is not None
    try:
        found = jaeger.start(tmp_path_factory.mktemp("jaeger"), otlp_host=host)
    except FileNotFoundError as err:
        pytest.fail(str(err))
    yield found
    found.stop()


@pytest.fixture(scope="package")
def ladle_system(
    request: pytest.FixtureRequest,
    k8s_cluster: KubeCluster,
    k8s_api: ApiClient,
    k8s_local_nodes: list[LocalNode],
    collector: Jaeger,
) -> Iterator[System]:
    """The chart installed with its defaults (two operator replicas, leader election) but for
    tracing, its operator running as pods on the local nodes; and the GPUPool from examples/.
    The gateway and every runtime pod export traces to ``collector`` at a sampling ratio of 0:
    only the requests whose client samples them (a ``traceparent`` flagged so) are traced, as a
    team does that traces a few requests on purpose. The cluster
    has the Gateway API Inference Extension's InferencePool and InferenceModelRewrite CRDs and
    the Gateway API's HTTPRoute before the operator starts, as a cluster whose admins run a
    GAIE gateway does, so every service gets a pool (and a route where it names a Gateway)."""
    system_namespace = _namespace(k8s_api, "ladle-e2e-system")
    namespace = _namespace(k8s_api, "e2e")
    system = System(k8s_cluster, k8s_api, system_namespace, namespace)
    request.config.stash[_SYSTEM_KEY] = system
    crds = (gaie.module_dir() / gaie.POOL_CRD, gaie.module_dir() / gaie.MODEL_REWRITE_CRD)
    for path in (*crds, gaie.http_route_crd()):
        crd = system.kubectl("apply", "--server-side", "-f", str(path))
        assert crd.returncode == 0, crd.stderr
    # kubectl wait errs rather than waits while a new CRD has no conditions yet.
    wait_until(
        lambda: system.kubectl(
            "wait", "--for=condition=Established",
            "crd/inferencepools.inference.networking.k8s.io",
            "crd/inferencemodelrewrites.inference.networking.x-k8s.io",
            "crd/httproutes.gateway.networking.k8s.io", "--timeout=5s",
        ).returncode
        == 0,
        "the GAIE and HTTPRoute CRDs to be Established",
        60,
    )  # fmt: skip
    started = time.monotonic()
    helm = subprocess.run(
        [
            str(k8s_cluster.helm), "upgrade", "--install", RELEASE, str(CHART),
            "--namespace", system_namespace, "--wait", "--timeout", "180s",
            "--set", f"tracing.endpoint={collector.otlp}", "--set", "tracing.samplingRatio=0",
        ],
        env=k8s_cluster.env(),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert helm.returncode == 0, helm.stderr
    print(f"\nchart operator Ready as pods in {time.monotonic() - started:.1f}s")
    pool = system.kubectl("apply", "-f", str(EXAMPLES / "gpupool.yaml"))
    assert pool.returncode == 0, pool.stderr
    try:
        yield system
    finally:
        del request.config.stash[_SYSTEM_KEY]
        system.kubectl("delete", "lisvc", "--all", "-n", namespace, "--wait=false")
        subprocess.run(
            [str(k8s_cluster.helm), "uninstall", RELEASE, "-n", system_namespace, "--wait"],
            env=k8s_cluster.env(),
            capture_output=True,
            timeout=120,
            check=False,
        )
        system.kubectl("delete", "gpupool", "h200", "--wait=false")
        for name in (namespace, system_namespace):
            system.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture(scope="package")
def gateway_url(ladle_system: System) -> str:
    """One Ready gateway pod of the chart, by its pod address (the host reaches pods by
    route, as a test client inside the cluster would)."""

    def find() -> str | None:
        for pod in ladle_system.core.list_namespaced_pod(
            ladle_system.system_namespace, label_selector="app.kubernetes.io/component=gateway"
        ).items:
            conditions = pod.status.conditions or ()
            ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
            if ready and pod.status.pod_ip:
                return f"http://{pod.status.pod_ip}:8080"
        return None

    url: str = wait_until(find, "a Ready gateway pod", 180)
    return url


def wait_routed(gateway_url: str, model: str, timeout: float = 120) -> None:
    """Until the gateway answers a request for ``model``: a pod being Ready is not enough, as
    the gateway learns of it by its watch, and a breaker opened while no pod was ready stays
    open for its ``openSeconds``."""

    def routed() -> bool:
        body = {"model": model, "prompt": "Hi", "max_tokens": 1}
        try:
            reply = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60)
        except httpx.HTTPError:
            return False
        return reply.is_success

    wait_until(routed, f"the gateway to route {model}", timeout)


@dataclass(frozen=True)
class LoadResult:
    """What a stopped `Load` sent: ``completed`` and ``failed`` requests (each one an HTTP
    error, a broken stream or a connection that failed), the distinct errors, and ``problem``
    when there is no report to read (the benchmark exited early or did not stop)."""

    completed: int
    failed: int
    errors: tuple[str, ...] = ()
    problem: str | None = None

    @property
    def clean(self) -> bool:
        """It ran until stopped, sent requests, and every one of them was answered in full."""
        return self.problem is None and self.completed > 0 and self.failed == 0


class Load:
    """`ladle bench serve` through the gateway, in the background, until stopped. ``stop``
    sends SIGTERM, on which the benchmark sends nothing more, lets the requests in flight
    finish, and writes its report: the returned `LoadResult`.

    Without ``rate`` it keeps ``concurrency`` requests in flight, back to back, which holds a
    core busy for as long as it runs; with one it sends ``rate`` requests a second (Poisson),
    still at most ``concurrency`` at once: enough traffic to judge and to lose, on a machine
    that the rest of the suite shares. ``headers`` go with every request (a priority band)."""

    def __init__(
        self,
        gateway_url: str,
        model: str,
        concurrency: int,
        output_len: int,
        rate: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="ladle-load-"))
        self.result_file = self.folder / "result.json"
        extra = ["--request-rate", str(rate)] if rate else []
        if headers:
            extra += ["--header", *(f"{k}={v}" for k, v in headers.items())]
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "ladle.cli", "bench", "serve",
                "--base-url", gateway_url, "--model", model,
                "--num-prompts", "100000", "--max-concurrency", str(concurrency), *extra,
                "--input-len", "16", "--output-len", str(output_len), "--ignore-eos",
                "--result-file", str(self.result_file),
            ],
            stdout=subprocess.DEVNULL,  # its errors go to stderr, which pytest shows on a failure
        )  # fmt: skip

    def stop(self, timeout: float = 90) -> LoadResult:
        """Never raises (it runs in ``finally`` blocks): what went wrong is in ``problem``."""
        early = self.proc.poll()
        if early is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                shutil.rmtree(self.folder, ignore_errors=True)
                return LoadResult(0, 0, problem=f"did not finish within {timeout:.0f}s of SIGTERM")
        try:
            report = json.loads(self.result_file.read_text())
        except (OSError, ValueError) as err:
            return LoadResult(0, 0, problem=f"exited {self.proc.returncode} with no report ({err})")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        errors = tuple(sorted({str(r["error"]) for r in report["requests"] if r.get("error")}))
        problem = None if early is None else f"exited {early} before it was stopped"
        return LoadResult(int(report["completed"]), int(report["failed"]), errors, problem)
