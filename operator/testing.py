"""Drive a real ``ladle operator`` process and a real cluster: for the tests and the benchmark.

Nothing here is imported by the operator itself; the ``kubernetes`` client it uses is a
development dependency, imported lazily.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ladle.operator.api import GROUP, ISVC_PLURAL, POOL_PLURAL, VERSION

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    """Poll until ``predicate`` returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OperatorProcess:
    """``ladle operator`` as a child process, with its log file and its HTTP endpoints."""

    def __init__(
        self,
        kubeconfig: Path,
        log: Path,
        *,
        lease_namespace: str,
        lease: str,
        identity: str,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = free_port()
        self.identity = identity
        self.log = log
        argv = [
            sys.executable, "-m", "ladle.cli", "operator",
            "--metrics-bind-address", f"127.0.0.1:{self.port}",
            "--lease-namespace", lease_namespace,
            "--lease-name", lease,
            "--identity", identity,
            *extra_args,
        ]  # fmt: skip
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def get(self, path: str) -> tuple[int, str]:
        """(HTTP status, body) of one of the operator's endpoints; (0, "") if unreachable."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as rsp:
                return rsp.status, rsp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name: str, **labels: str) -> float | None:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        _, text = self.get("/metrics")
        total = None
        for line in text.splitlines():
            if not line.startswith(name) or line[len(name)] not in " {":
                continue
            series, _, value = line.rpartition(" ")
            if all(f'{key}="{val}"' in series for key, val in labels.items()):
                total = (total or 0.0) + float(value)
        return total

    def is_leader(self) -> bool:
        return self.proc.poll() is None and self.metric("ladle_operator_leader") == 1.0

    def wait_leading(self, timeout: float = 60) -> None:
        wait_for(self.is_leader, f"operator {self.identity} to lead", timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def peak_rss_bytes(self) -> int:
        """VmHWM: the process's peak resident set size so far (Linux)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc status")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


# A test fixture's signature: start an operator with this identity.
OperatorFactory = Callable[[str], OperatorProcess]


class Kube:
    """The real kubectl plus the admin API client, for reading what the operator wrote."""

    def __init__(self, kubectl: Path, env: Mapping[str, str], api: ApiClient) -> None:
        from kubernetes import client

        self.kubectl_path = kubectl
        self.env = dict(env)
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)
        self.policy = client.PolicyV1Api(api)

    def kubectl(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run kubectl; never raises on a non-zero exit, so callers can assert on it."""
        return subprocess.run(
            [str(self.kubectl_path), *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def apply(self, manifest: str, namespace: str | None = None) -> None:
        scope = ["-n", namespace] if namespace else []
        result = self.kubectl("apply", *scope, "-f", "-", stdin=manifest)
        if result.returncode != 0:
            raise AssertionError(f"kubectl apply failed: {result.stderr}")

    def isvc(self, namespace: str, name: str) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, ISVC_PLURAL, name)
        return cast(dict[str, Any], obj)

    def pool(self, name: str) -> dict[str, Any]:
        obj = self.custom.get_cluster_custom_object(GROUP, VERSION, POOL_PLURAL, name)
        return cast(dict[str, Any], obj)

    @staticmethod
    def condition(obj: Mapping[str, Any], type_: str) -> dict[str, Any]:
        for cond in (obj.get("status") or {}).get("conditions") or ():
            if cond["type"] == type_:
                return dict(cond)
        return {}

    def wait_condition(
        self,
        namespace: str,
        name: str,
        type_: str,
        status: str = "True",
        reason: str | None = None,
        timeout: float = 60,
    ) -> dict[str, Any]:
        """Wait until a condition of the current generation matches; return the object."""

        def matches() -> dict[str, Any] | None:
            obj = self.isvc(namespace, name)
            cond = self.condition(obj, type_)
            current = (obj.get("status") or {}).get("observedGeneration") == obj["metadata"][
                "generation"
            ]
            if (
                current
                and cond.get("status") == status
                and (reason is None or cond.get("reason") == reason)
            ):
                return obj
            return None

        what = f"{namespace}/{name} {type_}={status}" + (f" ({reason})" if reason else "")
        return wait_for(matches, what, timeout)

    def events(self, namespace: str, name: str) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the Events about one object."""
        listed = self.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name}"
        )
        return [(str(e.type), str(e.reason), str(e.message)) for e in listed.items]
