"""The Gateway API Inference Extension fronting Ladle's runtime pods: the operator's
InferencePool, GAIE's own endpoint picker (built from the pinned module) choosing a pod through
Envoy's ext_proc protocol, and its choice moving away from a pod whose queue grows.

No Envoy runs here: the test plays the gateway. It sends the picker a request's headers and
body as Envoy would, reads the endpoint from ``x-gateway-destination-endpoint``, and sends the
request there; which proves what any GAIE gateway (Istio, kgateway, Envoy Gateway) would do.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from ladle.runtime_metrics import PROTOCOL_GAUGES, WAITING, samples
from ladle_dev.cluster import gaie
from ladle_dev.cluster.control_plane import free_ports
from ladle_dev.pytest_plugin import wait_until

from .conftest import Load, System, cpu_service

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "picked"
MODEL = "picked-model"
DESTINATION = "x-gateway-destination-endpoint"


class Picker:
    """GAIE's endpoint picker for one pool, as a process on the host (which reaches pods by
    route), and an ext_proc client that asks it for an endpoint as Envoy would."""

    def __init__(self, system: System, pool: str, log: Path) -> None:
        binary = gaie.TOOLSET.bin_dir() / "epp"
        if not binary.is_file():
            pytest.fail("the endpoint picker is not built: run `make cluster-build`")
        self.port, health, metrics = free_ports(3)
        self.log = log
        env = {**os.environ, "KUBECONFIG": str(system.cluster.kubeconfig)}
        self.proc = subprocess.Popen(
            [
                str(binary), "--pool-name", pool, "--pool-namespace", system.namespace,
                "--grpc-port", str(self.port), "--grpc-health-port", str(health),
                "--metrics-port", str(metrics), "--secure-serving=false",
                "--enable-pprof=false",
            ],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = ext_proc_grpc.ExternalProcessorStub(self.channel)

    def pick(self, body: dict[str, Any]) -> str:
        """The endpoint the picker chooses for one completion request (``ip:port``)."""
        return self.route(body)[0]

    def route(self, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The endpoint the picker chooses for one completion request (``ip:port``), and the
        body as it has the gateway send it there (a model rewrite changes it)."""
        raw = json.dumps(body).encode()
        headers = {
            ":method": "POST",
            ":path": "/v1/completions",
            ":authority": "gateway.test",
            "content-type": "application/json",
            "content-length": str(len(raw)),
        }
        messages = [
            ext_proc.ProcessingRequest(
                request_headers=ext_proc.HttpHeaders(
                    headers=base_pb2.HeaderMap(
                        headers=[
                            base_pb2.HeaderValue(key=k, raw_value=v.encode())
                            for k, v in headers.items()
                        ]
                    ),
                    end_of_stream=False,
                )
            ),
            ext_proc.ProcessingRequest(
                request_body=ext_proc.HttpBody(body=raw, end_of_stream=True)
            ),
        ]
        endpoint, sent = None, b""
        for response in self.stub.Process(iter(messages), timeout=10):
            if response.HasField("immediate_response"):
                raise AssertionError(f"the picker refused: {response.immediate_response}")
            if response.HasField("request_headers"):
                mutation = response.request_headers.response.header_mutation
                for option in mutation.set_headers:
                    if option.header.key == DESTINATION:
                        value = option.header.raw_value or option.header.value.encode()
                        endpoint = value.decode()
            if response.HasField("request_body"):
                sent += response.request_body.response.body_mutation.streamed_response.body
        if endpoint is None:
            raise AssertionError(f"the picker named no endpoint:\n{self.log.read_text()[-3000:]}")
        return endpoint, json.loads(sent) if sent else body

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# With a pool per variant, and a canary rollout that holds at its first step (the quality gate
# off: the test reads where requests go, not what they answer).
SPEC: dict[str, Any] = {
    "replicas": 2,
    "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 512, "maxNumSeqs": 1},
    "inferencePool": {"perVariant": True, "gateway": {"name": "inference"}},
    "rollout": {
        "steps": [50, 100],
        "intervalSeconds": 3600,
        "progressDeadlineSeconds": 7200,
        "analysis": {"quality": {"enabled": False}},
    },
}


def ready_pods(system: System, variant: str | None = None) -> dict[str, str]:
    """The service's Ready pods (of one variant, if given): their IP by pod name."""
    return {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in system.pods(NAME)
        if system.condition(p, "Ready") == "True"
        and not p["metadata"].get("deletionTimestamp")
        and variant in (None, p["metadata"]["labels"].get("ladle.dev/variant"))
    }


@pytest.fixture(scope="module")
def pods(ladle_system: System) -> Iterator[dict[str, str]]:
    """Two Ready runtime pods of one service, one slot each: their IP by pod name."""
    ladle_system.apply([cpu_service(NAME, MODEL, **SPEC)])

    def ready() -> dict[str, str] | None:
        found = ready_pods(ladle_system)
        return found if len(found) == 2 else None

    yield wait_until(ready, "two Ready pods", 300)
    ladle_system.kubectl("delete", "lisvc", NAME, "-n", ladle_system.namespace, "--wait=false")


def waiting(ip: str) -> float:
    page = httpx.get(f"http://{ip}:8000/metrics", timeout=5).text
    return sum(v for _, v in samples(page, (PROTOCOL_GAUGES[WAITING],))[PROTOCOL_GAUGES[WAITING]])


def test_the_reference_picker_routes_to_ladle_pods_and_away_from_a_growing_queue(
    ladle_system: System, pods: dict[str, str], tmp_path: Path
) -> None:
    listed = ladle_system.kubectl(
        "get", "inferencepools", "-n", ladle_system.namespace, NAME, "-o", "json"
    )
    assert listed.returncode == 0, listed.stderr
    pool = json.loads(listed.stdout)
    assert pool["spec"]["selector"]["matchLabels"] == {"ladle.dev/inferenceservice": NAME}
    endpoints = {f"{ip}:8000" for ip in pods.values()}

    picker = Picker(ladle_system, NAME, tmp_path / "epp.log")
    try:

        def first_pick() -> str | None:
            try:
                return picker.pick({"model": MODEL, "prompt": "Hello", "max_tokens": 4})
            except (grpc.RpcError, AssertionError):
                return None  # not serving yet, or no pod known to it yet

        chosen = wait_until(first_pick, "the picker to name an endpoint", 120)
        assert chosen in endpoints
        # The gateway's part: the request goes to the pod the picker chose, and is served.
        answer = httpx.post(
            f"http://{chosen}/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"]

        # Load one pod directly until its engine queues: the picker reads that from the
        # model-server protocol's gauges and sends everything to the other one.
        busy_ip, idle_ip = sorted(pods.values())
        load = Load(f"http://{busy_ip}:8000", MODEL, concurrency=4, output_len=96)
        try:
            wait_until(lambda: waiting(busy_ip) >= 2, "the loaded pod's queue to grow", 120)
            time.sleep(0.5)  # a few of the picker's 50 ms metric refreshes
            picks = [
                picker.pick({"model": MODEL, "prompt": f"Question {i}:", "max_tokens": 4})
                for i in range(10)
            ]
            queued = waiting(busy_ip)
        finally:
            result = load.stop()
        assert result.problem is None, result.problem
        assert queued >= 1, "the loaded pod's queue drained while the picker was asked"
        assert picks == [f"{idle_ip}:8000"] * 10, picks
    finally:
        picker.close()


def backends(system: System, name: str) -> list[tuple[str, int]] | None:
    """The pools a service's HTTPRoute sends its model to, with their weights."""
    shown = system.kubectl("get", "httproute", name, "-n", system.namespace, "-o", "json")
    if shown.returncode != 0:
        return None
    (rule,) = json.loads(shown.stdout)["spec"]["rules"]
    return [(b["name"], b["weight"]) for b in rule["backendRefs"]]


def test_a_service_without_replicas_falls_back_through_the_fallbacks_picker(
    ladle_system: System, pods: dict[str, str], tmp_path: Path
) -> None:
    """Behind a GAIE gateway the operator routes a service with no available replica to its
    fallback's pool, where GAIE's model rewrite has the fallback's picker rename the requests
    to the model its pods serve: the reference picker does that rename, and the pod it picks
    answers the renamed request."""
    asker = cpu_service(
        "asker",
        "asker-model",
        replicas=0,
        minReplicas=0,
        fallback=NAME,
        inferencePool={"gateway": {"name": "inference"}},
    )
    ladle_system.apply([asker])

    # The route's one backend, the fallback's pool (the CRD defaults its weight to 1).
    fallen = [(NAME, 1)]
    wait_until(lambda: backends(ladle_system, "asker") == fallen, "the route at zero", 60)
    picker = Picker(ladle_system, NAME, tmp_path / "epp-fallback.log")
    try:

        def renamed() -> tuple[str, dict[str, Any]] | None:
            try:
                chosen = picker.route({"model": "asker-model", "prompt": "Hello", "max_tokens": 4})
            except (grpc.RpcError, AssertionError):
                return None  # not serving yet
            return chosen if chosen[1]["model"] == MODEL else None  # the rewrite not read yet

        endpoint, body = wait_until(renamed, "the picker to rename the model", 120)
    finally:
        picker.close()
    ladle_system.kubectl("delete", "lisvc", "asker", "-n", ladle_system.namespace)
    assert endpoint in {f"{ip}:8000" for ip in ready_pods(ladle_system).values()}
    assert body == {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    answer = httpx.post(f"http://{endpoint}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == MODEL


def test_each_variants_picker_picks_only_its_pods_during_a_canary(
    ladle_system: System, pods: dict[str, str], tmp_path: Path
) -> None:
    """Behind a GAIE gateway a canary's weights hold by the route's weighted backends, one pool
    per variant (tests/operator/test_inference_pool.py follows the weights through a rollout);
    what that needs of the pickers is that each chooses among its own variant's pods only."""
    ladle_system.apply([cpu_service(NAME, MODEL, **SPEC, quantization={"weights": "int8"})])

    def at_first_step() -> dict[str, str] | None:
        rollout = (ladle_system.isvc(NAME).get("status") or {}).get("rollout") or {}
        canary = ready_pods(ladle_system, "canary")
        return canary if rollout.get("step") == 1 and canary else None

    canary = wait_until(at_first_step, "the canary's first step on a Ready pod", 300)
    # A GAIE gateway would split the model between the variants' pools by the step's weights.
    split = [(f"{NAME}-stable", 50), (f"{NAME}-canary", 50)]
    wait_until(lambda: backends(ladle_system, NAME) == split, "the route at 50/50", 60)
    stable = ready_pods(ladle_system, "stable")
    assert stable
    assert not set(stable) & set(canary)
    for variant, members in (("stable", stable), ("canary", canary)):
        picker = Picker(ladle_system, f"{NAME}-{variant}", tmp_path / f"epp-{variant}.log")
        try:

            def first_pick(picker: Picker = picker) -> str | None:
                try:
                    return picker.pick({"model": MODEL, "prompt": "Hello", "max_tokens": 4})
                except (grpc.RpcError, AssertionError):
                    return None

            picks = [wait_until(first_pick, f"the {variant} picker to name an endpoint", 120)]
            picks += [
                picker.pick({"model": MODEL, "prompt": f"Question {i}:", "max_tokens": 4})
                for i in range(6)
            ]
        finally:
            picker.close()
        assert set(picks) <= {f"{ip}:8000" for ip in members.values()}, (variant, picks)
        answer = httpx.post(
            f"http://{picks[0]}/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
