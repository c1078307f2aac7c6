"""A real Prometheus scrapes the chart's operator and gateway pods and real runtime pods on the
local nodes, through scrape configs converted from the chart's own PodMonitors, and evaluates
the chart's own rules: every recording rule and every dashboard query answers, and faults fire
their alerts in /api/v1/alerts.

The faults: `beta` (whose fallback is `alpha`) runs one sequence at a time with one waiting, so
a burst of requests is answered 429 by its runtime, which its breaker counts; the breaker opens
and traffic moves to alpha (LadleCircuitBreakerOpen).
Then a gateway replica is Running but answers nothing, so the autoscaler holds alpha's count on
unknown metrics (LadleAutoscalerMetricsFrozen, with its `for` shortened through the chart value).
Then alpha goes away, so beta's requests fail fast with 503 and its availability budget burns
(LadleAvailabilityBudgetBurn, critical). The system (operator, gateway, local nodes) is the
`ladle_system` fixture of tests/e2e/conftest.py.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ladle.monitoring import promconfig
from ladle_dev.cluster import build, sre_tools
from ladle_dev.pytest_plugin import KubeCluster, local_namespace_annotations, wait_until

from .conftest import cpu_service

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ladle"
DASHBOARD = CHART / "dashboards" / "ladle.json"
RELEASE = "ladle-e2e"  # tests/e2e/conftest.py installs the chart under this name
ENGINE = {"kvCacheMemory": "64Mi", "maxModelLen": 512}
FROZEN_FOR = "10s"
# Chart values shortened so that each fault's alert fires within seconds, not minutes.
SHORTENED = {
    "autoscalerFrozenFor": FROZEN_FOR,
    "kvCacheUsage": "0.3",
    "kvCacheFor": "10s",
    "autoscalerAtMaxFor": "10s",
    "preemptionsFor": "10s",
    "breakerOpenFor": "10s",
    "fallbackTrafficFor": "10s",
    "podsUnschedulableFor": "10s",
    "quotaExhaustedFor": "10s",
}
System = Any  # the `ladle_system` fixture's type lives in conftest.py
# The panels whose queries may return nothing here, and why; every other panel must return
# data, and every query must evaluate without error or warning.
MAY_BE_EMPTY = {
    # ladle_operator_rollout_* exist only for a service in a canary rollout, and no service
    # here has spec.rollout (tests/e2e/test_rollouts.py runs canaries).
    "Canary weight": "the canary weight gauge exists only while a canary runs",
    "Gate results": "analyses and rollbacks are counted only once a canary is analysed",
    "Rollout phase": "the phase and step gauges exist only while a canary runs",
    # Waits are observed only once a request waited for a slot: beta binds early, and alpha's
    # traffic never fills its slots (tests/gateway/test_flow_control.py queues requests).
    "Queue wait p99, by band": "observed only once a request has waited for a slot",
    "Mean queue wait, by tenant": "counted only once a request has waited for a slot",
}
# Grafana's variables, as "All" and a sensible window.
VARIABLES = {
    "$__rate_interval": "1m",
    "$namespace": ".*",
    "$inferenceservice": ".*",
    "$gpupool": ".*",
}


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, **params: str) -> Any:
        response = httpx.get(self.url + path, params=params, timeout=30)
        body = response.json()
        assert body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    def evaluate(self, expr: str) -> list[dict[str, Any]]:
        """``query``, with no warning from Prometheus either (a malformed ``le`` label, floats
        mixed with native histograms): the query is right, not merely accepted."""
        response = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = response.json()
        assert body["status"] == "success", (expr, body)
        assert not body.get("warnings"), (expr, body["warnings"])
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def firing(self, alertname: str, **labels: str) -> list[dict[str, Any]]:
        return [
            a
            for a in self.get("/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == alertname
            and a["state"] == "firing"
            and labels.items() <= a["labels"].items()
        ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def render_monitoring(namespace: str) -> list[dict[str, Any]]:
    """The chart's PrometheusRule and PodMonitors for the release the system runs."""
    helm = build.bin_dir() / "helm"
    values = ["prometheusRule", *(f"podMonitors.{c}" for c in ("runtime", "gateway", "operator"))]
    argv = [str(helm), "template", RELEASE, str(CHART), "--namespace", namespace]
    argv += ["--kube-version", "1.34.0"]
    for value in values:
        argv += ["--set", f"monitoring.{value}.enabled=true"]
    for value, shortened in SHORTENED.items():
        argv += ["--set", f"monitoring.alerts.{value}={shortened}"]
    rendered = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


@pytest.fixture(scope="module")
def prometheus(
    ladle_system: System, k8s_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    folder = tmp_path_factory.mktemp("prometheus")
    objects = render_monitoring(ladle_system.system_namespace)
    (rule,) = [d for d in objects if d["kind"] == "PrometheusRule"]
    monitors = [d for d in objects if d["kind"] == "PodMonitor"]
    (folder / "ladle-rules.yaml").write_text(yaml.safe_dump(promconfig.rule_groups(rule)))
    config = {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "rule_files": ["ladle-rules.yaml"],
        "scrape_configs": promconfig.scrape_configs(
            monitors, kubeconfig=str(k8s_cluster.kubeconfig), interval="2s"
        ),
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    binary = sre_tools.TOOLSET.bin_dir() / "prometheus"
    if not binary.is_file():
        pytest.fail("prometheus is not built: run `make cluster-build`")
    port = free_port()
    log = folder / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                str(binary),
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1d",
            ],
            cwd=folder,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", process, log)

    def ready() -> bool:
        try:
            return httpx.get(prom.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return process.poll() is not None  # exited: fail below with its log

    wait_until(ready, "Prometheus to start", timeout=60)
    assert process.poll() is None, log.read_text()[-3000:]
    yield prom
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def namespace(ladle_system: System) -> Iterator[str]:
    """A namespace of our own on the local nodes, emptied when the module ends."""
    from kubernetes import client

    name = f"monitoring-{uuid.uuid4().hex[:6]}"
    meta = client.V1ObjectMeta(name=name, annotations=local_namespace_annotations())
    ladle_system.core.create_namespace(client.V1Namespace(metadata=meta))
    yield name
    ladle_system.kubectl("delete", "lisvc", "--all", "-n", name, "--wait=false")
    ladle_system.kubectl("delete", "namespace", name, "--wait=false")


def service(name: str, model: str, **spec: Any) -> dict[str, Any]:
    return cpu_service(name, model, **{"engine": ENGINE, **spec})


def traffic(gateway: str, model: str, count: int) -> list[int]:
    """Streamed completions through the gateway; their status codes."""
    codes = []
    for index in range(count):
        body = {
            "model": model,
            "prompt": f"Count to ten, attempt {index}:",
            "max_tokens": 6,
            "stream": True,
        }
        with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=120) as r:
            r.read()
            codes.append(r.status_code)
    return codes


def complete(gateway: str, model: str, tokens: int) -> httpx.Response:
    body = {"model": model, "prompt": "Hello", "max_tokens": tokens, "ignore_eos": True}
    return httpx.post(gateway + "/v1/completions", json=body, timeout=120)


def substitute(expr: str) -> str:
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets") or ():
            out.append((panel["title"], substitute(target["expr"])))
    return out


LABEL_VALUES = re.compile(r"label_values\((?P<match>.+),\s*(?P<label>\w+)\)")


def variable_queries() -> dict[str, tuple[str, str]]:
    """Each query variable of the dashboard: name → (series selector, label), as Grafana's
    ``label_values(selector, label)`` asks Prometheus's /api/v1/label/<label>/values."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = LABEL_VALUES.fullmatch(variable["query"])
        assert found is not None, variable["query"]
        out[variable["name"]] = (substitute(found["match"]), found["label"])
    return out


def stuck_gateway_replica(system: System) -> dict[str, Any]:
    """A pod the operator counts as a gateway replica (the chart's gateway labels, Running, an
    "http" port) whose process listens on nothing: a replica stuck before it serves."""
    (gateway, *_) = json.loads(
        system.kubectl(
            "get", "pods", "-n", system.system_namespace,
            "-l", "app.kubernetes.io/component=gateway", "-o", "json",
        ).stdout
    )["items"]  # fmt: skip
    labels = dict(gateway["metadata"]["labels"])
    labels.pop("pod-template-hash", None)  # not the ReplicaSet's to adopt
    (container,) = gateway["spec"]["containers"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"stuck-gateway-{uuid.uuid4().hex[:6]}",
            "namespace": system.system_namespace,
            "labels": labels,
        },
        "spec": {
            "nodeName": gateway["spec"]["nodeName"],  # a local node: a real process
            "tolerations": gateway["spec"].get("tolerations", []),
            "securityContext": gateway["spec"].get("securityContext", {}),
            # Its process, PID 1 without a handler, ignores SIGTERM: no grace to wait out.
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "gateway",
                    "image": container["image"],
                    "command": ["python3", "-c", "import time; time.sleep(3600)"],
                    "ports": container["ports"],
                }
            ],
        },
    }


def recorded(prometheus: Prometheus) -> list[str]:
    groups = prometheus.get("/api/v1/rules", type="record")["groups"]
    return [rule["name"] for group in groups for rule in group["rules"]]


def test_prometheus_scrapes_the_pods_answers_every_rule_and_panel_and_fires_on_faults(
    ladle_system: System, prometheus: Prometheus, namespace: str, gateway_url: str
) -> None:
    system = ladle_system
    # A model loads for longer than the breaker's default 30 s without a ready pod on this
    # machine: only the failure rate may open these breakers.
    breaker = {"minimumCalls": 4, "openSeconds": 600, "noReadyPodsSeconds": 3600}
    beta_breaker = {**breaker, "countRateLimited": True}
    # Model names are cluster-wide at the gateway: these are this namespace's own.
    alpha, beta = f"alpha-{namespace}", f"beta-{namespace}"
    documents = [
        # Autoscaled, within bounds that keep it at one replica: the autoscaler's series exist.
        # Saturated below, a waiting stream's first token can take longer than the default
        # minute on two loaded cores, and those 504s count against its breaker (a full run saw
        # it open there, 100% of 4 calls failed, and the saturation alerts never fired).
        service(
            "alpha", alpha, circuitBreaker=breaker, timeouts={"firstTokenSeconds": 600},
            minReplicas=1, maxReplicas=1, autoscaling={"targetConcurrency": 16},
        ),
        service(
            "beta", beta, fallback="alpha", circuitBreaker=beta_breaker,
            engine={**ENGINE, "maxNumSeqs": 1, "maxWaitingRequests": 1},
            # Bound early, a burst reaches the pod, which refuses it (late, the gateway holds it).
            routing={"maxConcurrency": 0},
        ),
    ]  # fmt: skip
    result = system.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(documents)
    )
    assert result.returncode == 0, result.stderr
    for name in ("alpha", "beta"):
        wait_until(
            lambda name=name: (
                system.condition(
                    json.loads(
                        system.kubectl("get", "lisvc", name, "-n", namespace, "-o", "json").stdout
                    ),
                    "Ready",
                )
                == "True"
            ),
            f"{name} to be Ready",
            timeout=300,
        )

    # Every component is scraped through the PodMonitors' selection, with the labels they add.
    def targets_up() -> bool:
        up = prometheus.query("up == 1")
        jobs = {(s["metric"]["job"], s["metric"].get("inferenceservice", "")) for s in up}
        return {
            ("ladle-operator", ""),
            ("ladle-gateway", ""),
            ("ladle-runtime", "alpha"),
            ("ladle-runtime", "beta"),
        } <= jobs

    wait_until(targets_up, "every target to be scraped", timeout=120)
    wait_until(
        lambda: prometheus.query('sum(up{job="ladle-operator"}) == 2'),
        "both operator replicas, leader and standby, to be scraped",
        timeout=120,
    )

    # Traffic, then the first fault: a burst beta's runtime answers with 429s opens its breaker.
    for model in (alpha, beta):
        wait_until(
            lambda m=model: traffic(gateway_url, m, 1) == [200], f"the gateway to route {model}"
        )
    assert traffic(gateway_url, alpha, 4) == [200] * 4
    assert traffic(gateway_url, beta, 4) == [200] * 4
    with ThreadPoolExecutor(12) as pool:
        burst = list(pool.map(lambda _: complete(gateway_url, beta, 32).status_code, range(12)))
    assert burst.count(429) >= 4, burst

    def moved() -> bool:
        r = complete(gateway_url, beta, 2)
        return r.status_code == 200 and r.headers.get("x-ladle-fallback") == "alpha"

    wait_until(moved, "beta's breaker to open and send its traffic to alpha", timeout=300)
    traffic(gateway_url, beta, 4)

    # Every recording rule (all the chart's, as Prometheus loaded them) answers with data.
    names = recorded(prometheus)
    (rule,) = [
        d for d in render_monitoring(system.system_namespace) if d["kind"] == "PrometheusRule"
    ]
    records = [r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r]
    assert sorted(names) == sorted(records)

    def all_recorded() -> list[str]:
        return [name for name in names if not prometheus.query(name)]

    wait_until(lambda: not all_recorded(), "every recording rule to have data", timeout=120)

    # Every dashboard query evaluates without error; all but MAY_BE_EMPTY's return data.
    queries = panel_queries()
    assert MAY_BE_EMPTY.keys() <= {title for title, _ in queries}  # the list is not stale
    empty = [(title, expr) for title, expr in queries if not prometheus.evaluate(expr)]
    assert [(t, e) for t, e in empty if t not in MAY_BE_EMPTY] == []

    # The dashboard's variables list what runs here.
    listed = {
        name: set(prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": match}))
        for name, (match, label) in variable_queries().items()
    }
    assert listed.keys() == {"namespace", "inferenceservice", "gpupool"}
    assert namespace in listed["namespace"], listed
    assert {"alpha", "beta"} <= listed["inferenceservice"], listed
    assert "h200" in listed["gpupool"], listed  # examples/gpupool.yaml, from tests/e2e/conftest.py

    wait_until(
        lambda: prometheus.firing(
            "LadleCircuitBreakerOpen", namespace=namespace, inferenceservice="beta"
        ),
        "LadleCircuitBreakerOpen to fire for beta",
        timeout=180,
    )
    assert not prometheus.firing("LadleAvailabilityBudgetBurn", inferenceservice="beta")
    # Beta's traffic keeps going to alpha: more than 10% of it, for longer than 10 s.
    wait_until(
        lambda: (
            traffic(gateway_url, beta, 2)
            and prometheus.firing(
                "LadleFallbackTrafficHigh", namespace=namespace, inferenceservice="beta"
            )
        ),
        "LadleFallbackTrafficHigh to fire for beta",
        timeout=180,
    )

    # Saturation: six streams of 300 tokens at once want about 1,900 tokens of alpha's 64 MiB
    # KV cache (about 1,400), so its engine preempts, its KV usage stays high, and its
    # autoscaler sits at maxReplicas (1) while saturated.
    saturated = ("LadleKVCacheHigh", "LadlePreemptionsHigh", "LadleAutoscalerAtMax")
    stop = threading.Event()

    def saturate() -> None:
        while not stop.is_set():
            complete(gateway_url, alpha, 300)

    saturating = ThreadPoolExecutor(6)
    loops = [saturating.submit(saturate) for _ in range(6)]
    try:
        wait_until(
            lambda: all(
                prometheus.firing(a, namespace=namespace, inferenceservice="alpha")
                for a in saturated
            ),
            f"{', '.join(saturated)} to fire for alpha",
            timeout=300,
        )
    finally:
        stop.set()
        # The streams under way finish during the next phase, which involves no pod.
        saturating.shutdown(wait=False)

    # Capacity: a pool whose quota is smaller than its service asks for, and a pool of a GPU
    # resource no node has. Only the operator and the scheduler are involved (the pods would
    # go to kwok's GPU nodes, or nowhere).
    pools = {
        f"quota-{namespace}": {
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "quota": {"gpus": 1},
        },
        f"missing-{namespace}": {"nodeSelector": {}, "resourceName": "example.com/missing-gpu"},
    }
    capacity = [
        *(
            {"apiVersion": "ladle.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": name},
             "spec": spec}
            for name, spec in pools.items()
        ),
        # GPU replicas size their KV cache by gpuMemoryUtilization, not kvCacheMemory.
        service("gamma", f"gamma-{namespace}", replicas=2, gpuPool=f"quota-{namespace}",
                resources={"gpus": 1}, engine={}),
        service("delta", f"delta-{namespace}", gpuPool=f"missing-{namespace}",
                resources={"gpus": 1}, engine={}),
    ]  # fmt: skip
    try:
        applied = system.kubectl(
            "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump_all(capacity)
        )
        assert applied.returncode == 0, applied.stderr
        wait_until(
            lambda: (
                prometheus.firing("LadleGPUPoolQuotaExhausted", gpupool=f"quota-{namespace}")
                and prometheus.firing(
                    "LadlePodsUnschedulable", namespace=namespace, inferenceservice="delta"
                )
            ),
            "LadleGPUPoolQuotaExhausted and LadlePodsUnschedulable to fire",
            timeout=180,
        )
    finally:
        system.kubectl("delete", "lisvc", "gamma", "delta", "-n", namespace, "--wait=true")
        system.kubectl("delete", "gpupool", *pools, "--wait=false")
    for loop in loops:
        loop.result()  # a saturating request that raised fails the test here

    # The second fault: a gateway replica is Running but answers nothing, so the autoscaler
    # cannot read alpha's held requests and holds its count; the operator's gauge says so and
    # the alert fires after FROZEN_FOR. (A hung *runtime* would not do: it turns NotReady within
    # ten seconds, and the autoscaler reads only Ready pods. This replica has no probes, so no
    # restart ends the fault before the alert can fire.)
    assert not prometheus.firing("LadleAutoscalerMetricsFrozen", namespace=namespace)
    stuck = stuck_gateway_replica(system)
    applied = system.kubectl("apply", "-f", "-", stdin=json.dumps(stuck))
    assert applied.returncode == 0, applied.stderr
    try:
        wait_until(
            lambda: prometheus.firing(
                "LadleAutoscalerMetricsFrozen", namespace=namespace, inferenceservice="alpha"
            ),
            "LadleAutoscalerMetricsFrozen to fire for alpha",
            timeout=120,
        )
    finally:
        name = stuck["metadata"]["name"]
        system.kubectl("delete", "pod", name, "-n", system.system_namespace, "--wait=true")
    wait_until(
        lambda: not prometheus.firing("LadleAutoscalerMetricsFrozen", namespace=namespace),
        "LadleAutoscalerMetricsFrozen to resolve once the stuck replica is gone",
        timeout=120,
    )

    # The third fault: the fallback goes away, beta's requests fail fast, the budget burns.
    deleted = system.kubectl("delete", "lisvc", "alpha", "-n", namespace, "--wait=false")
    assert deleted.returncode == 0, deleted.stderr

    def failing() -> bool:
        return traffic(gateway_url, beta, 10).count(503) == 10

    wait_until(failing, "beta to answer 503 without its fallback", timeout=120)
    deadline = time.monotonic() + 180
    while not prometheus.firing(
        "LadleAvailabilityBudgetBurn", inferenceservice="beta", severity="critical"
    ):
        assert time.monotonic() < deadline, prometheus.get("/api/v1/alerts")
        traffic(gateway_url, beta, 5)
        time.sleep(2)
    alert = prometheus.firing(
        "LadleAvailabilityBudgetBurn", inferenceservice="beta", long_window="1h"
    )[0]
    assert alert["annotations"]["runbook_url"].endswith("/LadleAvailabilityBudgetBurn.md")
    assert f"{namespace}/beta" in alert["annotations"]["summary"]
