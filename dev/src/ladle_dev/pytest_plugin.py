"""pytest fixtures for tests against a real local Kubernetes.

Enable with ``pytest_plugins = ["ladle_dev.pytest_plugin"]`` in ``tests/conftest.py``.
The cluster starts once per session, the first time a test asks for it, and stops at the end;
its local nodes (real kubelets running Ladle's images) start the first time a test asks for
them, after the images are built or found in the cache. Tests isolate themselves with
``k8s_namespace``. When a cluster test fails, the tail of every component log is attached to
its report, because "the pod never became Ready" is only debuggable with the scheduler's,
kubelets' and containerd's side of the story.

Fixtures:

- ``k8s_cluster`` (session): a :class:`KubeCluster` with ``kubeconfig``, ``server``, ``kubectl``,
  ``helm``, ``env()``, ``run_kubectl()``, ``api_client()`` and ``service_account_kubeconfig()``.
- ``k8s_api`` (session): an admin ``kubernetes.client.ApiClient``.
- ``k8s_env`` (session): environment with ``KUBECONFIG`` set and the binaries first on ``PATH``.
- ``k8s_local_nodes`` (session): the local nodes, started (the cluster's ``local_nodes()``).
- ``k8s_namespace`` (function): a fresh namespace whose ``default`` ServiceAccount exists;
  deleted after the test. Its pods go to kwok's fake nodes.
- ``local_namespace`` (function): the same, annotated so that every pod in it runs on the
  local nodes, in containers (``local_namespace_annotations``).
- ``sa_kubeconfig`` (function): ``sa_kubeconfig(namespace, name) -> Path``, a kubeconfig that
  authenticates as that ServiceAccount (TokenRequest API), for running code under real RBAC.

``--ladle-cluster-state DIR`` reuses a cluster started by ``ladle cluster up --state-dir DIR``
instead of starting one, which makes the edit-test loop seconds shorter; it is left running.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import yaml

from ladle_dev.cluster import build, images
from ladle_dev.cluster.control_plane import Cluster
from ladle_dev.cluster.node import LocalNode
from ladle_dev.cluster.nodes import LOCAL_NODE_LABEL

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

T = TypeVar("T")
_log = logging.getLogger("ladle_dev.wait")


def local_namespace_annotations() -> dict[str, str]:
    """Namespace annotations that send all its pods to the local nodes: PodNodeSelector adds
    the node selector, PodTolerationRestriction the toleration of their taint."""
    toleration = {"key": LOCAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}
    return {
        "scheduler.alpha.kubernetes.io/node-selector": f"{LOCAL_NODE_LABEL}=true",
        "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps([toleration]),
    }


def wait_until(
    predicate: Callable[[], T | None], what: str, timeout: float = 60.0, interval: float = 0.25
) -> T:
    """Poll ``predicate`` until it returns something truthy, and return that.

    An AssertionError from it is a verdict, not a state still to come: it fails the wait at
    once. Any other error is tried again (a 404 for an object not made yet is the usual case).
    At the deadline the TimeoutError names ``what``, the last value the predicate returned (but
    None) and its last error (chained too): a failure shows where the wait was stuck, not only
    that it was."""
    started = time.monotonic()
    deadline = started + timeout
    returned: T | None = None
    error: Exception | None = None
    while True:
        try:
            result = returned = predicate()
        except AssertionError:
            raise
        except Exception as err:
            error, result = err, None
        if result:
            # Where a slow test spends its time (`-o log_cli=true --log-cli-level=INFO`).
            _log.info("waited %.1f s for %s", time.monotonic() - started, what)
            return result
        if time.monotonic() > deadline:
            details = [] if returned is None else [f"last returned {_short(returned)}"]
            if error is not None:
                details.append(f"last error {_short(error)}")
            suffix = f" ({'; '.join(details)})" if details else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}{suffix}") from (
                error
            )
        time.sleep(interval)


def _short(value: object, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


@dataclass(frozen=True)
class KubeCluster:
    """A running local cluster, as tests see it."""

    cluster: Cluster
    bin_dir: Path

    @property
    def kubeconfig(self) -> Path:
        """Admin (``system:masters``) kubeconfig with embedded credentials."""
        return self.cluster.kubeconfig

    @property
    def server(self) -> str:
        return self.cluster.server

    @property
    def kubectl(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm(self) -> Path:
        return self.bin_dir / "helm"

    def env(self, kubeconfig: Path | None = None) -> dict[str, str]:
        """``os.environ`` plus ``KUBECONFIG`` and the cluster binaries first on ``PATH``."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(kubeconfig or self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run_kubectl(
        self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl; never raises on a non-zero exit, so tests can assert on it."""
        return subprocess.run(
            [str(self.kubectl), *args],
            env=self.env(kubeconfig),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def local_node(self, name: str) -> LocalNode:
        """The local node called ``name`` (a pod's ``spec.nodeName``)."""
        return next(node for node in self.cluster.local_nodes() if node.spec.name == name)

    def container_pid(self, pod: dict[str, Any], container: str) -> int:
        """The host's pid of a running container's first process, from its node's CRI."""
        status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == container)
        node = self.local_node(pod["spec"]["nodeName"])
        return node.container_pid(self.bin_dir, status["containerID"].split("://", 1)[1])

    def container_environ(self, pod: dict[str, Any], container: str) -> dict[str, str]:
        """The environment a running container's first process started with."""
        raw = Path(f"/proc/{self.container_pid(pod, container)}/environ").read_bytes()
        pairs = (item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
        return dict(pairs)

    def empty_dir(self, pod: dict[str, Any], volume: str) -> Path:
        """Where a pod's emptyDir volume lives on its node, seen from the host."""
        node = self.local_node(pod["spec"]["nodeName"])
        uid = str(pod["metadata"]["uid"])
        return node.kubelet_dir / "pods" / uid / "volumes" / "kubernetes.io~empty-dir" / volume

    def api_client(self, kubeconfig: Path | None = None) -> ApiClient:
        """A ``kubernetes`` client for the admin or for any kubeconfig (e.g. a ServiceAccount's)."""
        from kubernetes import config

        api: ApiClient = config.new_client_from_config(
            config_file=str(kubeconfig or self.kubeconfig)
        )
        return api

    def service_account_kubeconfig(
        self, namespace: str, name: str, path: Path, expiration_seconds: int = 3600
    ) -> Path:
        """Write a kubeconfig that authenticates as ServiceAccount ``namespace/name``.

        The token comes from the TokenRequest API, exactly what a projected token in a pod
        holds, so code run with it is subject to precisely the RBAC granted to that account.
        """
        from kubernetes import client

        with self.api_client() as admin:
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=expiration_seconds)
            )
            issued = client.CoreV1Api(admin).create_namespaced_service_account_token(
                name, namespace, request
            )
        if issued.status is None or not issued.status.token:
            raise RuntimeError(f"TokenRequest for {namespace}/{name} returned no token")
        token = issued.status.token
        ca = base64.b64encode((self.cluster.pki_dir / "ca.crt").read_bytes()).decode()
        user = f"system:serviceaccount:{namespace}:{name}"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "ladle",
                    "cluster": {"server": self.server, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "ladle",
                    "context": {"cluster": "ladle", "user": user, "namespace": namespace},
                }
            ],
            "current-context": "ladle",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("ladle").addoption(
        "--ladle-cluster-state",
        type=Path,
        default=None,
        help="reuse the cluster started by `ladle cluster up --state-dir DIR` (left running)",
    )


_CLUSTER_KEY = pytest.StashKey[KubeCluster]()
_NAMESPACE_KEY = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def k8s_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KubeCluster]:
    """The session's cluster; fails (never skips) if it cannot be built or started."""
    reuse: Path | None = request.config.getoption("--ladle-cluster-state")
    if reuse is not None:
        cluster = Cluster(reuse)
        handle = KubeCluster(cluster, build.bin_dir())
        request.config.stash[_CLUSTER_KEY] = handle
        yield handle
        return
    missing = build.missing()
    if missing:
        pytest.fail(f"cluster binaries not built ({', '.join(missing)}): run `make cluster-build`")
    cluster = Cluster(tmp_path_factory.mktemp("ladle-cluster"))
    seconds = cluster.up(start_local=False)
    print(f"\nlocal cluster Ready in {seconds:.1f}s at {cluster.server}")
    handle = KubeCluster(cluster, build.bin_dir())
    request.config.stash[_CLUSTER_KEY] = handle
    try:
        yield handle
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def k8s_local_nodes(k8s_cluster: KubeCluster) -> list[LocalNode]:
    """The cluster's local nodes, started on first use with this checkout's images (built
    now if the code changed: buildah reuses every layer it can)."""
    started = time.monotonic()
    try:
        images.build_all()
    except build.BuildError as err:
        pytest.fail(f"Ladle's images could not be built: {err}")
    print(f"\nimages ready in {time.monotonic() - started:.0f}s", flush=True)
    seconds = k8s_cluster.cluster.start_local_nodes()
    print(f"local nodes Ready in {seconds:.1f}s", flush=True)
    return k8s_cluster.cluster.local_nodes()


@pytest.fixture(scope="session")
def k8s_api(k8s_cluster: KubeCluster) -> Iterator[ApiClient]:
    with k8s_cluster.api_client() as api:
        yield api


@pytest.fixture(scope="session")
def k8s_env(k8s_cluster: KubeCluster) -> dict[str, str]:
    return k8s_cluster.env()


def _namespace(
    request: pytest.FixtureRequest, k8s_api: ApiClient, annotations: dict[str, str] | None
) -> Iterator[str]:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    core = client.CoreV1Api(k8s_api)
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"t-{slug}-{uuid.uuid4().hex[:6]}"
    meta = client.V1ObjectMeta(name=name, annotations=annotations)
    core.create_namespace(client.V1Namespace(metadata=meta))

    def has_default_sa() -> bool:
        try:
            core.read_namespaced_service_account("default", name)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    wait_until(has_default_sa, f"the default ServiceAccount in {name}")
    request.node.stash[_NAMESPACE_KEY] = name
    yield name
    core.delete_namespace(name)


@pytest.fixture
def k8s_namespace(request: pytest.FixtureRequest, k8s_api: ApiClient) -> Iterator[str]:
    """A namespace named after the test; ready for pods (its ``default`` ServiceAccount exists)."""
    yield from _namespace(request, k8s_api, None)


@pytest.fixture
def local_namespace(
    request: pytest.FixtureRequest, k8s_api: ApiClient, k8s_local_nodes: list[LocalNode]
) -> Iterator[str]:
    """A namespace whose pods run on the local nodes, in containers."""
    yield from _namespace(request, k8s_api, local_namespace_annotations())


@pytest.fixture
def sa_kubeconfig(k8s_cluster: KubeCluster, tmp_path: Path) -> Callable[[str, str], Path]:
    """``sa_kubeconfig(namespace, name)``: a kubeconfig for that (existing) ServiceAccount."""

    def make(namespace: str, name: str) -> Path:
        path = tmp_path / f"{namespace}-{name}.kubeconfig"
        return k8s_cluster.service_account_kubeconfig(namespace, name, path)

    return make


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item,
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Attach component logs (and the test namespace's events) to a failed cluster test."""
    report = yield
    handle = item.config.stash.get(_CLUSTER_KEY, None)
    if report.failed and handle is not None and "k8s_cluster" in getattr(item, "fixturenames", ()):
        report.sections.append(("ladle cluster logs", handle.cluster.log_tails()))
        namespace = item.stash.get(_NAMESPACE_KEY, None)
        if namespace is not None:
            events = handle.run_kubectl(
                "get", "events", "-n", namespace, "--sort-by=.lastTimestamp"
            )
            report.sections.append((f"events in {namespace}", events.stdout + events.stderr))
    return report
