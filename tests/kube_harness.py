"""Drive a real ``ladle operator`` process and a real cluster: for the tests and the benchmark.

Test-only (``tests/conftest.py`` puts this folder on the path; ``bench/operator_scale.py`` adds
it itself). Faults come from outside the operator: a TLS relay between it and the API server
that can stall chosen requests, SIGSTOP, etcd compaction, and pod status written as a kubelet
would write it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from ladle.api import GROUP, ISVC_PLURAL, POOL_PLURAL, VERSION
from ladle_dev.pytest_plugin import wait_until

if TYPE_CHECKING:
    from kubernetes.client import ApiClient


def free_port(consecutive: int = 1) -> int:
    """A port free on every address, with the ``consecutive - 1`` ports after it free too (a
    multi-node rank listens on its master port and the next)."""
    while True:
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("", 0))
            port: int = first.getsockname()[1]
            if port + consecutive > 65536:
                continue  # where the local port range reaches the top, the next would not exist
            try:
                for offset in range(1, consecutive):
                    stack.enter_context(socket.socket()).bind(("", port + offset))
            except OSError:
                continue
            return port


def metric_total(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` in a Prometheus exposition whose labels include
    ``labels``; None when there are none."""
    total = None
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name)] not in " {":
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{key}="{val}"' in series for key, val in labels.items()):
            total = (total or 0.0) + float(value)
    return total


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
        return metric_total(self.get("/metrics")[1], name, **labels)

    def reconciles(self, kind: str = "isvc") -> float:
        """Reconciles of ``kind`` ended so far (ok or error)."""
        return self.metric("ladle_operator_reconcile_total", kind=kind) or 0.0

    def reconcile_after(
        self, poke: Callable[[], object], kind: str = "isvc", timeout: float = 60
    ) -> None:
        """Run ``poke`` (a change that makes the operator look again) and return once a
        reconcile has ended after it: "nothing changed" is then checked against a look the
        operator has taken, not against a sleep."""
        before = self.reconciles(kind)
        poke()
        wait_until(lambda: self.reconciles(kind) > before, f"a {kind} reconcile", timeout)

    def is_leader(self) -> bool:
        return self.proc.poll() is None and self.metric("ladle_operator_leader") == 1.0

    def wait_leading(self, timeout: float = 60) -> None:
        wait_until(self.is_leader, f"operator {self.identity} to lead", timeout)

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


class OperatorFactory(Protocol):
    """A test fixture's signature: start an operator with this identity."""

    def __call__(
        self, identity: str, kubeconfig: Path | None = None, extra_args: Sequence[str] = ()
    ) -> OperatorProcess: ...


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

    def isvc_versions(self, namespace: str, name: str) -> IsvcVersions:
        """Start recording every version of an InferenceService that the API server stores
        from now on (a watch, so a state that held for a moment is seen however busy the
        machine is; a poller could sleep through it)."""
        return IsvcVersions(self, namespace, name)

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
        return wait_until(matches, what, timeout)

    def events(self, namespace: str, name: str) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the Events about one object."""
        listed = self.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name}"
        )
        return [(str(e.type), str(e.reason), str(e.message)) for e in listed.items]

    def wait_event(
        self, namespace: str, name: str, type_: str, reason: str, at_least: int = 1
    ) -> list[str]:
        """The messages of one object's Events of this type and reason, once ``at_least`` are
        listed: the operator posts Events in the background, after the status it reports."""

        def posted() -> list[str] | None:
            found = [m for t, r, m in self.events(namespace, name) if (t, r) == (type_, reason)]
            return found if len(found) >= at_least else None

        return wait_until(posted, f"{at_least} {type_} {reason} event(s) about {namespace}/{name}")

    def event_objects(self, namespace: str, name: str) -> list[Any]:
        """The Events about one object, as the API returns them (count included)."""
        listed = self.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name}"
        )
        return list(listed.items)


# ---- faults and a kubelet's part, from outside the operator ----------------------------------


class IsvcVersions:
    """Versions of one InferenceService in the order its watch delivers them."""

    def __init__(self, kube: Kube, namespace: str, name: str) -> None:
        from kubernetes import watch

        self.objects: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._error: BaseException | None = None
        version = kube.isvc(namespace, name)["metadata"]["resourceVersion"]

        def record() -> None:
            nonlocal version
            try:
                # Short watches resumed from the last version, so that a finished recording
                # ends within two seconds rather than at a long watch's timeout.
                while not self._done.is_set():
                    for event in watch.Watch().stream(
                        kube.custom.list_namespaced_custom_object, GROUP, VERSION, namespace,
                        ISVC_PLURAL, field_selector=f"metadata.name={name}",
                        resource_version=version, timeout_seconds=2,
                    ):  # fmt: skip
                        if event["type"] == "ERROR":
                            raise AssertionError(f"the watch ended: {event['object']}")
                        self.objects.append(event["object"])
                        version = event["object"]["metadata"]["resourceVersion"]
            except BaseException as exc:  # reported by until()
                self._error = exc

        self._thread = threading.Thread(target=record, daemon=True)
        self._thread.start()

    def until(self, obj: Mapping[str, Any], timeout: float = 60) -> list[dict[str, Any]]:
        """Every version up to and including ``obj``'s."""
        version = obj["metadata"]["resourceVersion"]

        def delivered() -> int | None:
            assert self._error is None, f"the watch failed: {self._error!r}"
            versions = [o["metadata"]["resourceVersion"] for o in self.objects]
            return versions.index(version) + 1 if version in versions else None

        count = wait_until(delivered, f"the watch to deliver version {version}", timeout)
        self._done.set()
        self._thread.join(10)
        return self.objects[:count]


class Relay:
    """A TLS relay between one operator and the API server, in a thread of its own.

    It forwards every request (watches included, streamed) and notes each write it forwards.
    ``stall(match)`` holds back the requests that ``match(method, path)`` selects, and with
    ``streams=True`` also the data of responses already flowing, until ``heal()``; a held
    request whose client gives up is dropped, never forwarded late. ``expire_watches()`` makes
    every watch open now answer its next event with 410 Gone instead, as an API server does
    to a watch whose resourceVersion was compacted away: the client must re-list. Its serving
    certificate is signed by the cluster's CA, so the operator's kubeconfig changes only in its
    server URL.
    """

    HOP_HEADERS = frozenset(
        {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}
    )

    def __init__(self, upstream: str, pki_dir: Path, workdir: Path) -> None:
        import asyncio
        import ssl
        import threading

        self.upstream = upstream
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        cert, key = _sign_server_cert(pki_dir, workdir)
        self._server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_ssl.load_cert_chain(str(cert), str(key))
        self._client_ssl = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
        self.forwarded: list[tuple[float, str, str]] = []  # (monotonic, method, path) of writes
        self.held = 0  # requests stalled now, not yet forwarded or dropped
        self._match: Callable[[str, str], bool] | None = None
        self._streams = False
        self._watch_epoch = 0  # watches begun before this epoch are expired
        self._loop = asyncio.new_event_loop()
        self._healed: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start())

    def _call(self, coro: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self) -> None:
        import asyncio

        import aiohttp
        from aiohttp import web

        self._healed = asyncio.Event()
        self._healed.set()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._client_ssl, limit=0),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await web.TCPSite(
            self._runner, "127.0.0.1", self.port, ssl_context=self._server_ssl
        ).start()

    async def _handle(self, request: Any) -> Any:
        from aiohttp import web

        assert self._healed is not None
        match = self._match
        held = match is not None and match(request.method, request.path)
        self.held += held
        try:
            if held:
                await self._healed.wait()
            body = await request.read()
            if request.method != "GET":
                self.forwarded.append((time.monotonic(), request.method, request.path))
        finally:
            self.held -= held
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP_HEADERS}
        epoch = self._watch_epoch
        watching = request.query.get("watch") in ("true", "1")
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body or None, headers=headers
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in self.HOP_HEADERS
                },
            )
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                if self._streams:
                    await self._healed.wait()
                if watching and self._watch_epoch > epoch:
                    await response.write(GONE)
                    break
                await response.write(chunk)
            await response.write_eof()
            return response

    def stall(self, match: Callable[[str, str], bool], streams: bool = False) -> None:
        def start() -> None:
            assert self._healed is not None
            self._healed.clear()
            self._match, self._streams = match, streams

        self._loop.call_soon_threadsafe(start)

    def expire_watches(self) -> None:
        def expire() -> None:
            self._watch_epoch += 1

        self._loop.call_soon_threadsafe(expire)

    def heal(self) -> None:
        def stop() -> None:
            assert self._healed is not None
            self._match, self._streams = None, False
            self._healed.set()

        self._loop.call_soon_threadsafe(stop)

    def writes_after(self, moment: float) -> list[tuple[float, str, str]]:
        """Writes forwarded after ``moment`` (time.monotonic()), Lease requests aside."""
        return [w for w in list(self.forwarded) if w[0] > moment and "/leases/" not in w[2]]

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


GONE = (
    b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure",'
    b'"message":"too old resource version","reason":"Expired","code":410}}\n'
)


def _sign_server_cert(pki_dir: Path, workdir: Path) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1, signed by the local cluster's CA."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate((pki_dir / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki_dir / "ca.key").read_bytes(), None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = workdir / "relay.crt", workdir / "relay.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def with_server(kubeconfig: Path, server: str, path: Path) -> Path:
    """A copy of ``kubeconfig`` that talks to ``server`` (a relay) instead."""
    import yaml

    config = yaml.safe_load(kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = server
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def compact_etcd(etcd_port: int) -> int:
    """Compact etcd to its current revision, so any watch resuming from before gets 410 Gone.
    Returns the revision (etcd's JSON gateway; no etcdctl needed)."""
    import base64
    import json

    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{etcd_port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as rsp:
            answer: dict[str, Any] = json.loads(rsp.read())
            return answer

    key = base64.b64encode(b"/registry").decode()
    revision = int(call("/v3/kv/range", {"key": key, "limit": 1})["header"]["revision"])
    call("/v3/kv/compaction", {"revision": revision, "physical": True})
    return revision


MANUAL_NODE_LABEL = "ladle.dev/test-node"


def manual_node(name: str, gpus: int) -> dict[str, Any]:
    """A GPU Node that kwok leaves alone: its pods get only the status a test writes for them,
    as a kubelet would (the node-agent issue's pods will get theirs from real processes)."""
    resources = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {MANUAL_NODE_LABEL: name, "kubernetes.io/hostname": name},
        },
        # Only the pools made for it (they tolerate every taint) send pods here.
        "spec": {"taints": [{"key": MANUAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}]},
        "status": {
            "capacity": resources,
            "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


def kubelet_status(
    phase: str, *, ready: bool, waiting: tuple[str, str] | None = None
) -> dict[str, Any]:
    """The pod status a kubelet writes: Running and ready, or a container waiting (with the
    kubelet's reason and message, such as CreateContainerConfigError)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state: dict[str, Any] = (
        {"waiting": {"reason": waiting[0], "message": waiting[1]}}
        if waiting
        else {"running": {"startedAt": now}}
    )
    flag = "True" if ready else "False"
    return {
        "status": {
            "phase": phase,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                {"type": "Ready", "status": flag, "lastTransitionTime": now},
            ],
            "containerStatuses": [
                {
                    "name": "runtime",
                    "image": "registry.test/ladle-runtime:test",
                    "imageID": "",
                    "ready": ready,
                    "restartCount": 0,
                    "started": ready,
                    "state": state,
                }
            ],
            "podIP": "10.244.9.9",
            "startTime": now,
        }
    }


# ---- manifests and small reads shared by the operator tests ----------------------------------


def isvc_manifest(name: str, **spec: Any) -> str:
    import yaml

    body: dict[str, Any] = {"model": {"name": "smollm2"}, "resources": {"gpus": 1}}
    body.update(spec)
    return yaml.safe_dump(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": body,
        }
    )


def pool_manifest(name: str, **spec: Any) -> str:
    import yaml

    body: dict[str, Any] = {"nodeSelector": {"nvidia.com/gpu.present": "true"}}
    body.update(spec)
    return yaml.safe_dump(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "GPUPool",
            "metadata": {"name": name},
            "spec": body,
        }
    )


def manual_pool_manifest(name: str, node: str, **spec: Any) -> str:
    """A pool of one manual node, whose taints (a node without a kubelet gets some) it
    tolerates."""
    return pool_manifest(
        name, nodeSelector={MANUAL_NODE_LABEL: node}, tolerations=[{"operator": "Exists"}], **spec
    )


def gone(kube: Kube, *args: str) -> bool:
    result = kube.kubectl("get", *args, "--ignore-not-found", "-o", "name")
    return result.returncode == 0 and not result.stdout.strip()


def pods_of(kube: Kube, namespace: str, isvc: str) -> list[Any]:
    selector = f"ladle.dev/inferenceservice={isvc}"
    return list(kube.core.list_namespaced_pod(namespace, label_selector=selector).items)


def play_kubelet(kube: Kube, namespace: str, isvc: str, status: dict[str, Any]) -> list[str]:
    """Write ``status`` to every scheduled, non-terminating pod of ``isvc``; their names."""
    names = []
    for pod in pods_of(kube, namespace, isvc):
        if pod.spec.node_name and not pod.metadata.deletion_timestamp:
            kube.core.patch_namespaced_pod_status(pod.metadata.name, namespace, status)
            names.append(pod.metadata.name)
    return names


def finish_terminating_pods(kube: Kube, namespace: str, isvc: str) -> int:
    """What a kubelet does once a terminating pod's containers have exited."""
    from kubernetes import client

    done = 0
    for pod in pods_of(kube, namespace, isvc):
        if pod.metadata.deletion_timestamp:
            kube.core.delete_namespaced_pod(
                pod.metadata.name, namespace, body=client.V1DeleteOptions(grace_period_seconds=0)
            )
            done += 1
    return done
