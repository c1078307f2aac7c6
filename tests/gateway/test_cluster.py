"""The gateway against the real API server: its watch caches, its RBAC and its status writes,
routing to a real ``ladle serve`` process through Pod objects whose status the test writes as
a kubelet would (the local cluster has no kubelet; the node agent will run real pods later)."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kube_harness import wait_until
from kubernetes import client

from ladle.gateway.routes import parse_pod
from ladle.gateway.split import choose_variant
from ladle.gateway.watch import Informer
from ladle.kube import KubeClient
from ladle_dev.pytest_plugin import KubeCluster

from .conftest import GATEWAY_ACCOUNT, Process, free_port, start_ladle, start_runtime

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = f"gw-smollm2-{uuid.uuid4().hex[:6]}"
NODE = "gateway-test-node"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    proc = start_runtime(tmp_path_factory.mktemp("runtime"), MODEL)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def node(k8s_api: Any) -> str:
    """A Node that nothing manages (kwok only takes annotated ones): pods bound to it are ours."""
    core = client.CoreV1Api(k8s_api)
    body = client.V1Node(metadata=client.V1ObjectMeta(name=NODE))
    try:
        core.create_node(body)
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    return NODE


@pytest.fixture
def namespace(k8s_namespace: str, k8s_api: Any) -> Iterator[str]:
    """A test namespace emptied at once afterwards: its InferenceServices, so that the next
    test's claim on the same model name is the only one, and its pods, since no kubelet here
    confirms a pod's deletion and the namespace cannot go while they remain."""
    yield k8s_namespace
    client.CustomObjectsApi(k8s_api).delete_collection_namespaced_custom_object(
        "ladle.dev", "v1alpha1", k8s_namespace, "inferenceservices"
    )
    core = client.CoreV1Api(k8s_api)
    for pod in core.list_namespaced_pod(k8s_namespace).items:
        core.delete_namespaced_pod(pod.metadata.name, k8s_namespace, grace_period_seconds=0)


@pytest.fixture(scope="module")
def gateway(
    k8s_cluster: KubeCluster, gateway_chart: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Process]:
    """``ladle gateway`` as a process authenticated as the chart's gateway ServiceAccount."""
    folder = tmp_path_factory.mktemp("gateway")
    kubeconfig = k8s_cluster.service_account_kubeconfig(
        gateway_chart, GATEWAY_ACCOUNT, folder / "gateway.kubeconfig"
    )
    port = free_port()
    proc = start_ladle(
        folder / "gateway.log",
        "gateway", "--port", str(port), "--identity", "gw-test", "--scrape-interval", "1",
        port=port,
        env={"KUBECONFIG": str(kubeconfig)},
    )  # fmt: skip
    yield proc
    proc.stop()


def isvc(name: str, model: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "ladle.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"model": {"name": model}, "resources": {"gpus": 0}, **spec},
    }


def create_isvc(api: Any, namespace: str, obj: dict[str, Any]) -> None:
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "ladle.dev", "v1alpha1", namespace, "inferenceservices", obj
    )


def read_isvc(api: Any, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "ladle.dev", "v1alpha1", namespace, "inferenceservices", name
    )
    return obj


def create_ready_pod(
    api: Any, namespace: str, name: str, service: str, port: int, variant: str = "stable"
) -> None:
    """A runtime pod bound to our node, then its status written as the kubelet would."""
    core = client.CoreV1Api(api)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"ladle.dev/inferenceservice": service, "ladle.dev/variant": variant},
        },
        "spec": {
            "nodeName": NODE,
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {
                    "name": "runtime",
                    "image": "registry.test/ladle-runtime:test",
                    "ports": [{"name": "http", "containerPort": port}],
                }
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    set_pod_ready(api, namespace, name, True)


def set_pod_ready(api: Any, namespace: str, name: str, ready: bool) -> None:
    status = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    client.CoreV1Api(api).patch_namespaced_pod_status(name, namespace, {"status": status})


def models(gateway: Process) -> set[str]:
    return {m["id"] for m in httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]}


def test_routes_to_pods_it_watches_and_follows_their_readiness(
    k8s_api: Any, namespace: str, node: str, gateway: Process, runtime: Process
) -> None:
    create_isvc(k8s_api, namespace, isvc("chat", MODEL, timeouts={"scaleFromZeroSeconds": 1}))
    wait_until(lambda: MODEL in models(gateway), "the gateway to list the model")
    create_ready_pod(k8s_api, namespace, "chat-stable-0", "chat", runtime.port)

    oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)

    def answered() -> Any:
        try:
            return oai.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
        except openai.APIStatusError:
            return None

    raw = wait_until(answered, "a completion through the gateway", timeout=30)
    assert raw.headers["x-ladle-variant"] == "stable"
    request_id = raw.headers["x-request-id"]
    assert raw.parse().choices[0].message.content
    # The runtime logged the same request id: one grep finds both sides.
    wait_until(lambda: request_id in runtime.log_text(), "the request id in the runtime's log")
    stream = oai.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, stream=True)
    assert len(list(stream)) >= 1

    set_pod_ready(k8s_api, namespace, "chat-stable-0", False)

    def refused() -> bool:
        r = httpx.post(
            gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10
        )
        return r.status_code == 503 and r.json()["error"]["code"] == "no_ready_pods"

    wait_until(refused, "an unready pod to leave the route table", timeout=30)


def test_breaker_state_and_fallback_land_in_status_under_the_gateways_field_manager(
    k8s_api: Any, namespace: str, node: str, gateway: Process, runtime: Process
) -> None:
    create_isvc(k8s_api, namespace, isvc("chat", MODEL))
    create_ready_pod(k8s_api, namespace, "chat-stable-0", "chat", runtime.port)
    breaker = {"minimumCalls": 2, "openSeconds": 5, "halfOpenProbes": 1}
    flaky_model = f"flaky-{namespace}"
    create_isvc(
        k8s_api,
        namespace,
        isvc("flaky", flaky_model, fallback="chat", circuitBreaker=breaker, routing={"retries": 0}),
    )
    dead_port = free_port()  # nothing listens: connection refused
    create_ready_pod(k8s_api, namespace, "flaky-stable-0", "flaky", dead_port)
    wait_until(lambda: {MODEL, flaky_model} <= models(gateway), "both models routable")

    body = {"model": flaky_model, "prompt": "The sky is", "max_tokens": 2}
    codes = [
        httpx.post(gateway.url + "/v1/completions", json=body, timeout=30).status_code
        for _ in range(2)
    ]
    assert codes == [502, 502]

    def status_says(state: str) -> dict[str, Any] | None:
        st = (read_isvc(k8s_api, namespace, "flaky").get("status") or {}).get("gateway") or {}
        return st if (st.get("breaker") or {}).get("state") == state else None

    opened = wait_until(lambda: status_says("Open"), "status.gateway.breaker Open", timeout=5)
    assert opened["fallback"] == "chat"
    assert opened["breaker"]["reportedBy"] == "gw-test"
    assert "failure rate 100%" in opened["breaker"]["reason"]
    moved = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    assert moved.status_code == 200
    assert moved.headers["x-ladle-fallback"] == "chat"
    assert moved.json()["model"] == MODEL  # the model was rewritten for the fallback
    managers = {
        m["manager"]: json.dumps(m.get("fieldsV1"))
        for m in read_isvc(k8s_api, namespace, "flaky")["metadata"]["managedFields"]
        if m.get("subresource") == "status"
    }
    assert '"f:gateway"' in managers["ladle-gateway"]
    assert '"f:conditions"' not in managers["ladle-gateway"]

    # The service recovers: its pod is replaced by one that answers; one probe closes it.
    client.CoreV1Api(k8s_api).delete_namespaced_pod(
        "flaky-stable-0", namespace, grace_period_seconds=0
    )
    create_ready_pod(k8s_api, namespace, "flaky-stable-1", "flaky", runtime.port)

    def half_open_then_closed() -> bool:
        # While open, requests for flaky_model are served by chat; after openSeconds one probe
        # reaches the new pod, which answers 400 (it serves MODEL): a 4xx is a success.
        httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
        return status_says("Closed") is not None

    wait_until(half_open_then_closed, "the breaker to half-open and close", timeout=60)
    closed = status_says("Closed")
    assert closed is not None
    assert "fallback" not in closed
    metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    for state in ("Open", "HalfOpen", "Closed"):
        line = (
            f'ladle_gateway_breaker_transitions_total{{namespace="{namespace}",'
            f'service="flaky",state="{state}"}}'
        )
        assert line in metrics


def test_a_model_name_conflict_shows_in_both_services_and_clears(
    k8s_api: Any, namespace: str, node: str, gateway: Process
) -> None:
    model = f"conflict-{namespace}"
    create_isvc(k8s_api, namespace, isvc("a-older", model))
    wait_until(lambda: model in models(gateway), "the model to be routable")
    # Created within one second they tie on creationTimestamp; namespace/name then decides,
    # and these names sort in creation order either way.
    create_isvc(k8s_api, namespace, isvc("b-newer", model))

    def condition(name: str) -> dict[str, Any] | None:
        for cond in (read_isvc(k8s_api, namespace, name).get("status") or {}).get(
            "conditions"
        ) or ():
            if cond["type"] == "ModelNameConflict":
                return dict(cond)
        return None

    kept = wait_until(lambda: condition("a-older"), "the conflict in the older service's status")
    lost = wait_until(lambda: condition("b-newer"), "the conflict in the newer service's status")
    assert (kept["status"], kept["reason"]) == ("True", "KeptByThisService")
    assert f"also claimed by {namespace}/b-newer" in kept["message"]
    assert (lost["status"], lost["reason"]) == ("True", "RoutedElsewhere")
    assert f"{namespace}/a-older" in lost["message"]
    owned = [
        m["manager"] for m in read_isvc(k8s_api, namespace, "b-newer")["metadata"]["managedFields"]
    ]
    assert "ladle-gateway" in owned
    listing = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]
    assert [m["owned_by"] for m in listing if m["id"] == model] == [f"{namespace}/a-older"]

    client.CustomObjectsApi(k8s_api).delete_namespaced_custom_object(
        "ladle.dev", "v1alpha1", namespace, "inferenceservices", "a-older"
    )
    wait_until(lambda: condition("b-newer") is None, "the conflict to clear once one claim goes")
    listing = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]
    assert [m["owned_by"] for m in listing if m["id"] == model] == [f"{namespace}/b-newer"]


def test_a_held_request_is_signalled_in_status_and_served_when_a_pod_is_ready(
    k8s_api: Any, namespace: str, node: str, gateway: Process, runtime: Process
) -> None:
    create_isvc(k8s_api, namespace, isvc("chat", MODEL, replicas=0, minReplicas=0))
    wait_until(lambda: MODEL in models(gateway), "the gateway to list the model")

    async def held_then_served() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as http:
            request = asyncio.ensure_future(
                http.post(
                    gateway.url + "/v1/completions",
                    json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                )
            )
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    (read_isvc(k8s_api, namespace, "chat").get("status") or {}).get("gateway") or {}
                ).get("heldSince"),
                "status.gateway.heldSince",
            )
            assert not request.done()
            await asyncio.to_thread(
                create_ready_pod, k8s_api, namespace, "chat-stable-0", "chat", runtime.port
            )
            return await request

    response = asyncio.run(held_then_served())
    assert response.status_code == 200
    wait_until(
        lambda: (
            "heldSince"
            not in (
                (read_isvc(k8s_api, namespace, "chat").get("status") or {}).get("gateway")
                or {"heldSince": 1}
            )
        ),
        "heldSince to be cleared",
    )


def test_a_restarted_gateway_keeps_the_canary_split_from_status(
    k8s_cluster: KubeCluster,
    gateway_chart: str,
    k8s_api: Any,
    namespace: str,
    node: str,
    runtime: Process,
    tmp_path: Path,
) -> None:
    """The split lives in ``status.rollout.weights``, not in a gateway's memory: a fresh
    gateway process sends every session to the variant the one before it did. Sessions
    (``x-session-id``) make the split exact: each key's variant follows from the weights
    alone, so a gateway that fell back to all-stable, or split evenly, shows at once."""
    create_isvc(k8s_api, namespace, isvc("chat", MODEL))
    create_ready_pod(k8s_api, namespace, "chat-stable-0", "chat", runtime.port)
    create_ready_pod(k8s_api, namespace, "chat-canary-0", "chat", runtime.port, "canary")
    weights = [{"variant": "stable", "weight": 30}, {"variant": "canary", "weight": 70}]
    sessions = [f"user-{i}" for i in range(16)]
    table = tuple((w["variant"], w["weight"]) for w in weights)
    expected = {
        s: choose_variant(table, {"stable", "canary"}, rng=random.Random(), sticky=s.encode())
        for s in sessions
    }
    assert set(expected.values()) == {"stable", "canary"}  # these keys tell the two apart
    kubeconfig = k8s_cluster.service_account_kubeconfig(
        gateway_chart, GATEWAY_ACCOUNT, tmp_path / "gateway.kubeconfig"
    )

    def start() -> Process:
        port = free_port()
        return start_ladle(
            tmp_path / f"gateway-{port}.log",
            "gateway", "--port", str(port), "--identity", "gw-restart",
            port=port,
            env={"KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip

    def served(gw: Process) -> dict[str, str]:
        out = {}
        for session in sessions:
            reply = httpx.post(
                gw.url + "/v1/completions",
                json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                headers={"x-session-id": session},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            out[session] = reply.headers["x-ladle-variant"]
        return out

    first = start()
    try:
        # No weights in status yet: stable takes everything, the canary's pod notwithstanding.
        assert set(served(first).values()) == {"stable"}
        client.CustomObjectsApi(k8s_api).patch_namespaced_custom_object_status(
            "ladle.dev", "v1alpha1", namespace, "inferenceservices", "chat",
            {"status": {"rollout": {"phase": "Progressing", "step": 2, "weights": weights}}},
        )  # fmt: skip
        # The weights arrive by the watch: every session lands where they say.
        before = wait_until(
            lambda: (seen := served(first)) == expected and seen,
            "the running gateway to split 30/70",
            timeout=30,
        )
    finally:
        first.stop()
    second = start()
    try:
        # A fresh process, Ready once it has listed services and pods: its very first answers
        # follow the weights in status.
        after = served(second)
        metrics = httpx.get(second.url + "/metrics", timeout=10).text
    finally:
        second.stop()
    assert after == before == expected
    for variant, count in collections.Counter(after.values()).items():
        line = next(
            x
            for x in metrics.splitlines()
            if x.startswith("ladle_gateway_requests_total{")
            and f'namespace="{namespace}"' in x
            and f'variant="{variant}"' in x
        )
        assert float(line.rsplit(" ", 1)[1]) == count, line


def test_the_watch_cache_lists_again_after_a_gap(
    k8s_cluster: KubeCluster,
    k8s_api: Any,
    namespace: str,
    node: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resume from the last version after a gap; when the watch cannot resume (an expired or
    refused version, a broken connection), list again and replace everything, so that a pod
    deleted during the gap disappears too."""
    monkeypatch.setenv("KUBECONFIG", str(k8s_cluster.kubeconfig))
    create_ready_pod(k8s_api, namespace, "a", "chat", 8000)

    async def scenario() -> None:
        api = KubeClient("test")
        changes = 0

        def changed() -> None:
            nonlocal changes
            changes += 1

        informer = Informer(
            api, f"/api/v1/namespaces/{namespace}/pods", parse_pod, changed,
            params={"labelSelector": "ladle.dev/inferenceservice"},
        )  # fmt: skip
        task = asyncio.ensure_future(informer.run())
        await asyncio.wait_for(informer.synced.wait(), 30)
        assert set(informer.items) == {(namespace, "a")}
        await asyncio.to_thread(create_ready_pod, k8s_api, namespace, "b", "chat", 8000)
        # Created, then its status written: the cache may see the two apart.
        await _until(lambda: (b := informer.items.get((namespace, "b"))) is not None and b.ready)
        await asyncio.to_thread(set_pod_ready, k8s_api, namespace, "b", False)
        await _until(lambda: not informer.items[(namespace, "b")].ready)
        assert informer.relists == 1

        task.cancel()  # a gap: the cache hears nothing until it runs again
        core = client.CoreV1Api(k8s_api)
        await asyncio.to_thread(core.delete_namespaced_pod, "a", namespace, grace_period_seconds=0)
        await asyncio.to_thread(create_ready_pod, k8s_api, namespace, "c", "chat", 8000)
        task = asyncio.ensure_future(informer.run())  # resumes from its last version
        await _until(lambda: set(informer.items) == {(namespace, "b"), (namespace, "c")})
        assert informer.relists == 1

        task.cancel()  # another gap, after which the watch cannot resume from where it was
        await asyncio.to_thread(core.delete_namespaced_pod, "b", namespace, grace_period_seconds=0)
        informer.version = "not-a-resource-version"
        task = asyncio.ensure_future(informer.run())
        await _until(lambda: set(informer.items) == {(namespace, "c")}, timeout=60)
        assert informer.relists == 2
        task.cancel()
        await api.close()

    asyncio.run(scenario())


async def _until(predicate: Any, timeout: float = 30) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("watch", "inferenceservices.ladle.dev", True),
        ("list", "pods", True),
        ("watch", "pods", True),
        ("patch", "inferenceservices.ladle.dev --subresource=status", True),
        ("patch", "inferenceservices.ladle.dev", False),
        ("update", "inferenceservices.ladle.dev --subresource=status", False),
        ("delete", "inferenceservices.ladle.dev", False),
        ("get", "secrets", False),
        ("list", "secrets", False),
        ("create", "pods", False),
        ("patch", "pods", False),
        ("list", "endpointslices.discovery.k8s.io", False),
        ("patch", "gpupools.ladle.dev --subresource=status", False),
    ],
)
def test_gateway_service_account_has_only_what_it_needs(
    k8s_cluster: KubeCluster, gateway_chart: str, verb: str, resource: str, allowed: bool
) -> None:
    answer = k8s_cluster.run_kubectl(
        "auth", "can-i", verb, *resource.split(), "--all-namespaces",
        f"--as=system:serviceaccount:{gateway_chart}:{GATEWAY_ACCOUNT}",
    )  # fmt: skip
    assert answer.stdout.strip() == ("yes" if allowed else "no")
