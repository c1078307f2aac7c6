"""The Gateway API Inference Extension fronting Ladle's runtime pods: the operator's
InferencePool, GAIE's own endpoint picker (built from the pinned module) choosing a pod through
Envoy's ext_proc protocol, and its choice moving away from a pod whose queue grows.

No Envoy runs here: the test plays the gateway. It sends the picker a request's headers and
body as Envoy would, reads the endpoint from ``x-gateway-destination-endpoint``, and sends the
request there; which proves what any GAIE gateway (Istio, kgateway, Envoy Gateway) would do.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
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
from ladle_dev.pytest_plugin import wait_until

from .conftest import Load, System, cpu_service

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "picked"
MODEL = "picked-model"
DESTINATION = "x-gateway-destination-endpoint"


def _free_ports(count: int) -> list[int]:
    """Distinct free ports: each socket stays bound until all are chosen (ports asked for
    one at a time may repeat, and the picker then fails to bind its second server)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


class Picker:
    """GAIE's endpoint picker for one pool, as a process on the host (which reaches pods by
    route), and an ext_proc client that asks it for an endpoint as Envoy would."""

    def __init__(self, system: System, pool: str, log: Path) -> None:
        binary = gaie.TOOLSET.bin_dir() / "epp"
        if not binary.is_file():
            pytest.fail("the endpoint picker is not built: run `make cluster-build`")
        self.port, health, metrics = _free_ports(3)
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
        for response in self.stub.Process(iter(messages), timeout=10):
            if response.HasField("immediate_response"):
                raise AssertionError(f"the picker refused: {response.immediate_response}")
            if response.HasField("request_headers"):
                mutation = response.request_headers.response.header_mutation
                for option in mutation.set_headers:
                    if option.header.key == DESTINATION:
                        value = option.header.raw_value or option.header.value.encode()
                        return value.decode()
        raise AssertionError(f"the picker named no endpoint:\n{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def pods(ladle_system: System) -> Iterator[dict[str, str]]:
    """Two Ready runtime pods of one service, one slot each: their IP by pod name."""
    ladle_system.apply(
        [
            cpu_service(
                NAME,
                MODEL,
                replicas=2,
                engine={"kvCacheMemory": "64Mi", "maxModelLen": 512, "maxNumSeqs": 1},
            )
        ]
    )

    def ready() -> dict[str, str] | None:
        found = {
            p["metadata"]["name"]: p["status"]["podIP"]
            for p in ladle_system.pods(NAME)
            if ladle_system.condition(p, "Ready") == "True"
            and not p["metadata"].get("deletionTimestamp")
        }
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
