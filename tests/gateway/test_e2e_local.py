"""End to end on the local cluster with real runtime pods (Ladle's runtime image on the local
nodes' kubelets): the operator makes the pods, the gateway routes to them. Both run here, on
the host, and reach the pods by their addresses, as from inside the cluster.

Kept lean: one module-wide operator and gateway, small KV caches, and short breaker windows
set through the spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml
from kube_harness import Kube, OperatorProcess, wait_until
from kubernetes import watch
from urllib3.exceptions import ProtocolError

from ladle_dev.cluster.node import LocalNode
from ladle_dev.pytest_plugin import KubeCluster, local_namespace_annotations

from .conftest import GATEWAY_ACCOUNT, Process, free_port, start_ladle

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

KEYS = (
    "keys: [{name: tiny, key: sk-tiny-key-0001, requestsPerMinute: 2},"
    " {name: tokens, key: sk-tokens-key-03, tokensPerMinute: 40},"
    " {name: ops, key: sk-ops-key-00002}]"
)
OPS = {"authorization": "Bearer sk-ops-key-00002"}


@pytest.fixture(scope="module")
def local(k8s_api: Any, k8s_local_nodes: list[LocalNode]) -> Iterator[str]:
    """A namespace whose pods run on the local nodes."""
    from kubernetes import client

    core = client.CoreV1Api(k8s_api)
    name = f"gateway-e2e-{uuid.uuid4().hex[:6]}"
    meta = client.V1ObjectMeta(name=name, annotations=local_namespace_annotations())
    core.create_namespace(client.V1Namespace(metadata=meta))
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="module")
def kube(k8s_cluster: KubeCluster, k8s_api: Any) -> Kube:
    return Kube(k8s_cluster.kubectl, k8s_cluster.env(), k8s_api)


@pytest.fixture(scope="module")
def operator(
    k8s_cluster: KubeCluster, gateway_chart: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    folder = tmp_path_factory.mktemp("operator")
    kubeconfig = k8s_cluster.service_account_kubeconfig(
        gateway_chart, "ladle", folder / "op.kubeconfig"
    )
    op = OperatorProcess(
        kubeconfig, folder / "operator.log", lease_namespace=gateway_chart, lease="ladle-operator",
        identity="gateway-e2e", extra_args=["--gateway-url", "http://ladle-gateway.ladle-system.svc/v1"],
    )  # fmt: skip
    op.wait_leading()
    yield op
    op.stop()


@pytest.fixture(scope="module")
def gateway(
    k8s_cluster: KubeCluster, gateway_chart: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Process]:
    folder = tmp_path_factory.mktemp("gateway")
    kubeconfig = k8s_cluster.service_account_kubeconfig(
        gateway_chart, GATEWAY_ACCOUNT, folder / "gw.kubeconfig"
    )
    keys = folder / "keys.yaml"
    keys.write_text(KEYS)
    port = free_port()
    proc = start_ladle(
        folder / "gateway.log", "gateway", "--port", str(port), "--api-keys-file", str(keys),
        "--scrape-interval", "1", port=port, env={"KUBECONFIG": str(kubeconfig)},
    )  # fmt: skip
    yield proc
    proc.stop()


def service(name: str, model: str, replicas: int, **spec: Any) -> str:
    body = {
        "model": {"name": model},
        # A CPU request, as every runtime pod should have: without one the kubelet gives a
        # pod the smallest CPU share (2 against other pods' 102-256), and under load it starves.
        "resources": {"gpus": 0, "cpu": "250m"},
        "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 512},
        "replicas": replicas,
        "minReplicas": min(replicas, 1),
        **spec,
    }
    return yaml.safe_dump(
        {
            "apiVersion": "ladle.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": body,
        }
    )


@pytest.fixture(scope="module")
def services(kube: Kube, local: str, operator: OperatorProcess) -> str:
    breaker = {"minimumCalls": 4, "openSeconds": 5, "halfOpenProbes": 1, "countRateLimited": True}
    # alpha opts in to the response cache; only greedy or seeded requests use it.
    kube.apply(service("alpha", "model-a", 2, responseCache={"enabled": True}), local)
    kube.apply(service("beta", "model-b", 1, fallback="alpha", circuitBreaker=breaker), local)
    kube.apply(service("gamma", "model-c", 0, minReplicas=0), local)
    for name in ("alpha", "beta"):
        kube.wait_condition(local, name, "Ready", timeout=300)
    return local


def complete(gateway: Process, model: str, prompt: str = "Hello", **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(gateway.url + "/v1/completions", json=body, headers=OPS, timeout=180)


def pod_counts(gateway: Process, namespace: str, svc: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for line in httpx.get(gateway.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ladle_gateway_upstream_requests_total{") and f'service="{svc}"' in line:
            pod = line.split('pod="')[1].split('"')[0]
            counts[pod] = counts.get(pod, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_two_models_reach_their_services_and_status_url_is_the_gateway(
    kube: Kube, services: str, gateway: Process
) -> None:
    for model in ("model-a", "model-b"):
        r = wait_until(
            lambda m=model: (x := complete(gateway, m)).status_code == 200 and x, f"{model} served"
        )
        assert r.json()["model"] == model
    assert (
        kube.isvc(services, "alpha")["status"]["url"] == "http://ladle-gateway.ladle-system.svc/v1"
    )


def test_a_shared_prefix_lands_on_one_pod_with_load_bounded(
    services: str, gateway: Process
) -> None:
    before = pod_counts(gateway, services, "alpha")
    prefix = "You are the Ladle assistant. Answer in one short sentence, politely. " * 3

    async def run() -> None:
        async with httpx.AsyncClient(timeout=180, headers=OPS) as client:
            for batch in range(10):  # two at a time: the bound (ceil(1.25 x 2 / 2) = 2) holds
                await asyncio.gather(
                    *(
                        client.post(
                            gateway.url + "/v1/completions",
                            json={
                                "model": "model-a",
                                "prompt": prefix + f"Q{batch}.{i}",
                                "max_tokens": 2,
                            },
                        )
                        for i in range(2)
                    )
                )

    asyncio.run(run())
    after = pod_counts(gateway, services, "alpha")
    served = sorted(after.get(p, 0) - before.get(p, 0) for p in after)
    assert sum(served) == 20
    assert served[-1] / 20 > 0.8


def test_the_spec_turns_on_the_response_cache_for_its_model_alone(
    services: str, gateway: Process
) -> None:
    greedy = {"prompt": "The cache in the cluster says", "temperature": 0}
    before = sum(pod_counts(gateway, services, "alpha").values())
    miss, hit = (complete(gateway, "model-a", **greedy) for _ in range(2))
    assert (miss.status_code, hit.status_code) == (200, 200), miss.text + hit.text
    assert (miss.headers["x-ladle-cache"], hit.headers["x-ladle-cache"]) == ("miss", "hit")
    assert hit.content == miss.content
    assert sum(pod_counts(gateway, services, "alpha").values()) == before + 1
    # Sampled requests to alpha, and any request to beta (no responseCache), bypass it.
    assert "x-ladle-cache" not in complete(gateway, "model-a", temperature=1.0).headers
    assert "x-ladle-cache" not in complete(gateway, "model-b", **greedy).headers


def test_an_api_key_over_its_limit_gets_429(services: str, gateway: Process) -> None:
    tiny = {"authorization": "Bearer sk-tiny-key-0001"}
    body = {"model": "model-a", "prompt": "Hi", "max_tokens": 1}
    codes = [
        httpx.post(
            gateway.url + "/v1/completions", json=body, headers=tiny, timeout=120
        ).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]


def test_a_key_over_its_tokens_per_minute_is_refused_on_the_pods_own_counts(
    services: str, gateway: Process
) -> None:
    """The limit is debited with the usage the runtime pod reports, also for a stream whose
    client did not ask for usage (the gateway asks the pod, and keeps the chunk to itself)."""
    key = {"authorization": "Bearer sk-tokens-key-03"}
    body = {"model": "model-a", "prompt": "Count:", "max_tokens": 24, "ignore_eos": True}
    used = 0
    for _ in range(2):  # 40 a minute: the first answer leaves credit, the second a debt
        with httpx.stream(
            "POST", gateway.url + "/v1/completions", json={**body, "stream": True},
            headers=key, timeout=120,
        ) as reply:  # fmt: skip
            assert reply.status_code == 200
            events = [e for e in reply.read().decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert not any(c.get("usage") for c in chunks), "usage the client did not ask for"
        assert sum(len(c["choices"]) for c in chunks) == 24
        used += 24 + 1  # the completion, and at least one prompt token
    assert used > 40
    over = httpx.post(gateway.url + "/v1/completions", json=body, headers=key, timeout=120)
    assert over.status_code == 429, over.text
    assert "tokens per minute" in over.json()["error"]["message"]
    assert int(over.headers["retry-after"]) >= 1
    limited = [
        line
        for line in httpx.get(gateway.url + "/metrics", timeout=10).text.splitlines()
        if line.startswith("ladle_gateway_rate_limited_total{") and 'key="tokens"' in line
    ]
    assert limited, "no rate_limited_total sample for the key"
    assert all('limit="tokens"' in line for line in limited), limited


def test_a_zero_replica_service_holds_the_request_until_a_pod_is_ready(
    kube: Kube, services: str, gateway: Process
) -> None:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300, headers=OPS) as client:
            request = asyncio.ensure_future(
                client.post(
                    gateway.url + "/v1/completions",
                    json={"model": "model-c", "prompt": "Hi", "max_tokens": 2},
                )
            )
            await asyncio.sleep(1)
            assert not request.done()
            await asyncio.to_thread(
                kube.kubectl, "scale", "lisvc", "gamma", "--replicas=1", "-n", services
            )
            return await request

    assert asyncio.run(run()).status_code == 200


def alpha_pods(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "pods", "-n", namespace, "-l", "ladle.dev/inferenceservice=alpha", "-o", "json"
    )  # fmt: skip
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def running(pod: dict[str, Any]) -> float:
    """The sequences a runtime pod is generating now, from its own metrics."""
    text = httpx.get(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ladle:num_requests_running{")
    )


def test_killing_a_pod_mid_load_loses_no_unstarted_request(
    kube: Kube, services: str, gateway: Process
) -> None:
    """Streams long enough (256 tokens) to be cut, and the pod killed is one that its own
    metrics say is generating: its streams end in an error event, every other stream ends in
    [DONE], and requests sent after the kill all go to the survivor."""

    async def run() -> tuple[list[str], list[int]]:
        async with httpx.AsyncClient(timeout=300, headers=OPS) as client:

            async def stream(i: int) -> str:
                body = {
                    "model": "model-a",
                    "prompt": f"Count {i}:",
                    "max_tokens": 256,
                    "stream": True,
                    "ignore_eos": True,
                }
                async with client.stream("POST", gateway.url + "/v1/completions", json=body) as r:
                    return (await r.aread()).decode()

            streams = [asyncio.ensure_future(stream(i)) for i in range(6)]
            busy = await asyncio.to_thread(
                wait_until,
                lambda: next((p for p in alpha_pods(kube, services) if running(p) >= 1), None),
                "an alpha pod generating",
                120,
            )
            assert not all(s.done() for s in streams), "every stream ended before the kill"
            await asyncio.to_thread(
                kube.kubectl,
                "delete", "pod", busy["metadata"]["name"], "-n", services,
                "--grace-period=0", "--force",
            )  # fmt: skip
            after = [
                client.post(
                    gateway.url + "/v1/completions",
                    json={"model": "model-a", "prompt": f"After {i}", "max_tokens": 2},
                )
                for i in range(4)
            ]
            codes = [r.status_code for r in await asyncio.gather(*after)]
            return list(await asyncio.gather(*streams)), codes

    texts, codes = asyncio.run(run())
    assert codes == [200] * 4
    ends = []
    for text in texts:
        last = [e for e in text.split("\n\n") if e][-1]
        ends.append("done" if last == "data: [DONE]" else json.loads(last[6:])["error"]["code"])
    assert set(ends) <= {"done", "upstream_disconnected"}, ends
    assert "upstream_disconnected" in ends, ends  # the killed pod held a stream


def test_breaker_trips_to_the_fallback_half_opens_and_closes(
    kube: Kube, services: str, gateway: Process
) -> None:
    # Beta runs one sequence with one waiting, so a burst is answered 429 by its runtime,
    # which this breaker counts. The gateway binds early: late, it would hold the burst itself.
    kube.kubectl(
        "patch", "lisvc", "beta", "-n", services, "--type=merge", "-p",
        '{"spec": {"engine": {"maxNumSeqs": 1, "maxWaitingRequests": 1},'
        ' "routing": {"maxConcurrency": 0}}}',
    )  # fmt: skip
    kube.wait_condition(services, "beta", "Ready", timeout=300)
    # Until the old pod is gone, the gateway would retry a 429 there.
    rolled = kube.kubectl(
        "rollout", "status", "deployment/beta-stable", "-n", services, "--timeout=300s"
    )
    assert rolled.returncode == 0, rolled.stderr

    # The breaker may open, half-open and close between two reads (openSeconds is 5), so
    # every status the gateway writes is watched.
    seen: list[dict[str, Any]] = []
    stream = watch.Watch()

    def follow() -> None:
        # Stopped, it lingers until its next event; the cluster's teardown may end it first.
        with contextlib.suppress(ProtocolError):
            for event in stream.stream(
                kube.custom.list_namespaced_custom_object, "ladle.dev", "v1alpha1", services,
                "inferenceservices", field_selector="metadata.name=beta", timeout_seconds=300,
            ):  # fmt: skip
                seen.append((event["object"].get("status") or {}).get("gateway") or {})

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()

    def moved() -> httpx.Response | None:
        with ThreadPoolExecutor(6) as pool:
            burst = list(
                pool.map(
                    lambda _: complete(gateway, "model-b", max_tokens=32, ignore_eos=True),
                    range(6),
                )
            )
        return next((r for r in burst if r.headers.get("x-ladle-fallback") == "alpha"), None)

    r = wait_until(moved, "beta's breaker to open and send traffic to alpha", timeout=120)
    assert r.status_code == 200
    assert r.json()["model"] == "model-a"
    wait_until(
        lambda: any(
            g.get("breaker", {}).get("state") == "Open" and g.get("fallback") == "alpha"
            for g in seen
        ),
        "the gateway to write beta's open breaker and its fallback into status",
    )
    stream.stop()
    kube.kubectl(
        "patch", "lisvc", "beta", "-n", services, "--type=json", "-p",
        '[{"op": "remove", "path": "/spec/engine/maxNumSeqs"},'
        ' {"op": "remove", "path": "/spec/engine/maxWaitingRequests"},'
        ' {"op": "remove", "path": "/spec/routing/maxConcurrency"}]',
    )  # fmt: skip
    kube.wait_condition(services, "beta", "Ready", timeout=300)

    def closed() -> bool:
        complete(gateway, "model-b")
        return kube.isvc(services, "beta")["status"]["gateway"]["breaker"]["state"] == "Closed"

    wait_until(closed, "beta's breaker to half-open and close", timeout=180)
    metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    for state in ("Open", "HalfOpen", "Closed"):
        assert f'namespace="{services}",service="beta",state="{state}"' in metrics


def test_a_pod_that_stops_answering_is_ejected_and_gets_no_traffic_while_ejected(
    kube: Kube, k8s_cluster: KubeCluster, services: str, gateway: Process
) -> None:
    """One of alpha's two pods is stopped (SIGSTOP) until the gateway has ejected it on
    first-token timeouts, then let go: Ready and healthy again, it still gets nothing until
    its ejection ends (300 s here), while the other pod serves everything."""
    outlier = {"consecutiveErrors": 2, "baseEjectionSeconds": 300, "maxEjectionPercent": 50}
    # Short enough to eject the stopped pod (its requests time out four at a time) before its
    # readiness probe takes it out of rotation (about 10 s); long enough for the other pod's
    # first tokens beside a busy suite (1 s was not).
    timeouts = {"firstTokenSeconds": 4}
    patch = {"spec": {"routing": {"outlierDetection": outlier}, "timeouts": timeouts}}
    kube.kubectl(
        "patch", "lisvc", "alpha", "-n", services, "--type=merge", "-p", json.dumps(patch)
    )  # fmt: skip

    def ready_alpha() -> list[dict[str, Any]] | None:
        pods = [
            p
            for p in alpha_pods(kube, services)
            if not p["metadata"].get("deletionTimestamp")
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions") or ()
            )
        ]
        return pods if len(pods) == 2 else None

    victim = wait_until(ready_alpha, "two Ready alpha pods", 240)[0]
    name = victim["metadata"]["name"]

    def ejections() -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(gateway.url + "/metrics", timeout=10).text.splitlines()
            if line.startswith("ladle_gateway_ejections_total{") and name in line
        )

    def burst(tag: str) -> list[int]:
        """Eight requests at once: about half of them reach the stopped pod together."""

        async def run() -> list[int]:
            async with httpx.AsyncClient(timeout=120, headers=OPS) as client:
                replies = await asyncio.gather(
                    *(
                        client.post(
                            gateway.url + "/v1/completions",
                            json={"model": "model-a", "prompt": f"{tag} {i}", "max_tokens": 2},
                        )
                        for i in range(8)
                    )
                )
            return [r.status_code for r in replies]

        return asyncio.run(run())

    pid = k8s_cluster.container_pid(victim, "runtime")
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: burst("Stopped") and ejections() >= 1, f"{name} to be ejected", 60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(ready_alpha, "both alpha pods Ready again", 120)
    before = pod_counts(gateway, services, "alpha")
    after_codes = [
        httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "model-a", "prompt": f"After {i}", "max_tokens": 2},
            headers=OPS,
            timeout=120,
        ).status_code
        for i in range(8)
    ]
    assert after_codes == [200] * 8
    after = pod_counts(gateway, services, "alpha")
    sent = {pod: after[pod] - before.get(pod, 0.0) for pod in after}
    assert not any(count for pod, count in sent.items() if pod.endswith(f"/{name}")), sent
    assert sum(sent.values()) >= 8, sent
    undo = [{"op": "remove", "path": f"/spec/{field}"} for field in ("routing", "timeouts")]
    kube.kubectl(
        "patch", "lisvc", "alpha", "-n", services, "--type=json", "-p", json.dumps(undo)
    )  # fmt: skip
