"""``ladle up``: the whole system on this machine, from nothing to a token, in one command.

The steps, each shown with its time: the Kubernetes binaries (built once, about 25 minutes
cold), Ladle's images (built by buildah from the Dockerfiles, cached by layer), the cluster
with its local nodes (a kubelet and containerd each, the images imported), the Helm chart with
the operator and gateway running as pods on those nodes, a GPUPool and the default
InferenceService from ``examples/``, and a Ready runtime pod that has answered one request.
Every step is idempotent, so running ``ladle up`` again resumes or re-checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ladle.words import plural
from ladle_dev.cluster import build, images
from ladle_dev.cluster.control_plane import Cluster, ClusterError, Options
from ladle_dev.cluster.node import NodeError

T = TypeVar("T")

CHART = build.REPO_ROOT / "charts" / "ladle"
EXAMPLES = build.REPO_ROOT / "examples"
RELEASE = "ladle"
SYSTEM_NAMESPACE = "ladle-system"
NAMESPACE = "default"
POOL_FILE = "gpupool.yaml"
SERVICE_FILE = "smollm2.yaml"
HTTP_PORT = 8000


class UpError(RuntimeError):
    """A step failed; the message says which and what to look at."""


@dataclass(frozen=True)
class Endpoint:
    pod: str
    base_url: str
    model: str
    # The gateway's URL for the same model, when the chart runs a gateway that routes it.
    gateway_url: str | None = None

    @property
    def front_door(self) -> str:
        return self.gateway_url or self.base_url

    def curl(self) -> str:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": "Hi!"}],
                "max_tokens": 32,
            }
        )
        return (
            f"curl -s {self.front_door}/chat/completions -H 'Content-Type: application/json' "
            f"-d '{body}'"
        )


class Progress:
    """Numbered steps with their durations, and a line whenever a long wait changes state."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.index = 0
        self._started = 0.0
        self._last = ""

    def step(self, title: str) -> None:
        self.index += 1
        self._started = time.monotonic()
        self._last = ""
        print(f"[{self.index}/{self.total}] {title}", flush=True)

    def note(self, text: str) -> None:
        """Print ``text`` if it differs from the last note (a wait's changing state)."""
        if text != self._last:
            self._last = text
            print(f"      {text} ({time.monotonic() - self._started:.0f}s)", flush=True)

    def done(self, detail: str = "") -> None:
        suffix = f": {detail}" if detail else ""
        print(f"      done in {time.monotonic() - self._started:.1f}s{suffix}", flush=True)


def wait_for(check: Callable[[], T | None], what: str, timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise UpError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(1.0)


class System:
    """The local cluster plus everything ``ladle up`` installs in it."""

    def __init__(self, state_dir: Path) -> None:
        self.cluster = Cluster(state_dir)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.cluster.kubeconfig)
        env["PATH"] = f"{build.bin_dir()}{os.pathsep}{env.get('PATH', '')}"
        return env

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=600, check=False
        )
        if check and proc.returncode != 0:
            raise UpError(f"`{' '.join(argv[:3])} ...` failed:\n{proc.stderr.strip()}")
        return proc

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(str(build.bin_dir() / "kubectl"), *args, check=check)

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    # -- the steps ------------------------------------------------------------------------------
    def up(self, options: Options, timeout: float) -> Endpoint:
        progress = Progress(6)
        progress.step("Kubernetes binaries (built from pinned Go modules, once)")
        if build.missing():
            build.build()
        progress.done(str(build.bin_dir()))

        progress.step("Ladle's images (buildah, from Dockerfile.runtime and Dockerfile.operator)")
        built = images.build_all()
        progress.done(
            ", ".join(f"{image.reference} {image.size / 2**30:.1f} GiB" for image in built[1:])
        )

        nodes = options.local_nodes
        progress.step(f"the cluster, with {plural(nodes, 'local node')} (kubelet, containerd)")
        if self._running():
            self.cluster.start_local_nodes()  # imports images rebuilt since it started
            progress.done(f"already running in {self.cluster.state_dir}")
        else:
            seconds = self.cluster.up(options)
            progress.done(f"Ready in {seconds:.1f}s at {self.cluster.server}")

        progress.step("the Helm chart, with the operator running as pods on the local nodes")
        self.run(
            str(build.bin_dir() / "helm"),
            "upgrade", "--install", RELEASE, str(CHART),
            "--namespace", SYSTEM_NAMESPACE, "--create-namespace",
            "--wait", "--timeout", f"{int(timeout)}s",
        )  # fmt: skip
        pods = self.kubectl_json(
            "get", "pods", "-n", SYSTEM_NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}"
        )["items"]
        progress.done(
            ", ".join(f"{p['metadata']['name']} on {p['spec'].get('nodeName')}" for p in pods)
        )

        progress.step(f"a GPUPool and the default InferenceService (examples/{SERVICE_FILE})")
        for name in (POOL_FILE, SERVICE_FILE):
            self.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES / name))
        service = yaml.safe_load((EXAMPLES / SERVICE_FILE).read_text())
        progress.done(f"inferenceservice/{service['metadata']['name']}")

        progress.step("a Ready runtime pod that answers")
        endpoint = self._wait_ready(service, progress, timeout)
        progress.done(f"{endpoint.pod} serves {endpoint.front_door}")
        return endpoint

    def _running(self) -> bool:
        try:
            return bool(self.cluster.running()) and all(self.cluster.running().values())
        except ClusterError:
            return False

    def _wait_ready(self, service: dict[str, Any], progress: Progress, timeout: float) -> Endpoint:
        name = service["metadata"]["name"]
        model = service["spec"]["model"]["name"]

        def ready_pod() -> dict[str, Any] | None:
            pods: list[dict[str, Any]] = self.kubectl_json(
                "get", "pods", "-n", NAMESPACE, "-l", f"ladle.dev/inferenceservice={name}"
            )["items"]
            for pod in pods:
                progress.note(f"{pod['metadata']['name']}: {describe(pod)}")
                conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
                if conditions.get("Ready") == "True" and pod["status"].get("podIP"):
                    return pod
            if not pods:
                progress.note("waiting for the operator to create the Deployment")
            return None

        pod = wait_for(ready_pod, f"a Ready pod of inferenceservice/{name}", timeout)
        base_url = f"http://{pod['status']['podIP']}:{HTTP_PORT}/v1"
        wait_for(lambda: answers(base_url, model), f"{base_url} to answer", 60)
        gateway = self._gateway_url()
        if gateway is not None:
            progress.note(f"the gateway at {gateway} learns the route")
            wait_for(lambda: answers(gateway, model), f"the gateway {gateway} to route", 60)
        return Endpoint(pod["metadata"]["name"], base_url, model, gateway)

    def _gateway_url(self) -> str | None:
        """The gateway Service's base URL (its ClusterIP, which kube-proxy serves from the
        host too), if the chart runs the gateway."""
        selector = ("-n", SYSTEM_NAMESPACE, "-l", "app.kubernetes.io/component=gateway")
        for service in self.kubectl_json("get", "services", *selector)["items"]:
            address = service["spec"].get("clusterIP")
            port = next((p["port"] for p in service["spec"]["ports"] if p["name"] == "http"), None)
            if address and port:
                return f"http://{address}/v1" if port == 80 else f"http://{address}:{port}/v1"
        return None

    def down(self) -> list[str]:
        return self.cluster.down()


def describe(pod: dict[str, Any]) -> str:
    """A pod's state in a few words, as `kubectl get pods` would show it."""
    status = pod.get("status", {})
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        if "waiting" in state:
            return str(state["waiting"].get("reason", "Waiting"))
        if "running" in state and not container.get("ready"):
            return "Running, not ready yet (loading the model)"
        if container.get("ready"):
            return "Ready"
    return str(status.get("phase", "Pending"))


def answers(base_url: str, model: str) -> bool:
    """One real completion of a token: proof that the printed curl works."""
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1}).encode()
    request = urllib.request.Request(
        f"{base_url}/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as rsp:
            return bool(rsp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def main_up(state_dir: Path, options: Options, timeout: float) -> int:
    system = System(state_dir)
    try:
        endpoint = system.up(options, timeout)
    except (UpError, ClusterError, build.BuildError, NodeError) as err:
        print(f"ladle up: {err}", file=sys.stderr)
        print(f"component logs: {system.cluster.log_dir}", file=sys.stderr)
        return 1
    print()
    where = "the gateway" if endpoint.gateway_url else "the runtime pod's own address"
    print(f"OpenAI base URL: {endpoint.front_door}   ({where}; model {endpoint.model})")
    print(endpoint.curl())
    if endpoint.gateway_url:
        print(f"the runtime pod {endpoint.pod} itself: {endpoint.base_url}")
    print()
    print('the cluster\'s own kubectl and helm, first on PATH (or: eval "$(ladle cluster env)"):')
    print(system.cluster.shell_env)
    print("kubectl get lisvc,pods -A -o wide     # then: ladle down")
    return 0


def main_down(state_dir: Path) -> int:
    system = System(state_dir)
    if not system.cluster.state_dir.exists():
        print(f"no cluster in {system.cluster.state_dir}: nothing to stop")
        return 0
    stopped = system.down()
    print(f"stopped {', '.join(stopped) or 'nothing'}; removed {system.cluster.state_dir}")
    return 0
