#!/usr/bin/env python3
"""Operator scale benchmark: 500 InferenceServices on 100 fake GPU nodes of 8 GPUs.

It starts a dedicated local cluster (``ladle cluster``, kwok nodes), installs the chart with no
operator replicas (CRDs, ServiceAccount, RBAC), runs ``ladle operator`` as a process under that
ServiceAccount, and creates the InferenceServices (1 replica, 1 GPU each) at a fixed rate. It
reports, against the targets:

- p50/p99 from the create request to the child Deployment appearing in a watch;
- the time from the first create until every InferenceService reports Ready;
- the operator's peak RSS (VmHWM).

Run: .venv/bin/python bench/operator_scale.py [--services 500] [--nodes 100] [--rate 10]
With ``--runs 3 --with-baseline`` it alternates baseline and operator runs, each on a fresh
cluster, and prints the median and range of each measure beside the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from kubernetes import client
from kubernetes.client import ApiClient

from ladle.api import parse_isvc
from ladle.operator.config import OperatorConfig
from ladle.operator.desired import desired_children
from ladle.operator.service_objects import desired_service
from ladle_dev.cluster import build
from ladle_dev.cluster.control_plane import Cluster, Options
from ladle_dev.pytest_plugin import KubeCluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "tests"))
from kube_harness import OperatorProcess, wait_until  # noqa: E402  (test helpers, by path)

NAMESPACE = "bench"
SYSTEM = "ladle-system"
TARGET_P99_SECONDS = 1.0
TARGET_ALL_READY_SECONDS = 120.0
TARGET_RSS_MB = 300.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


class Recorder:
    """Watches Deployments and InferenceServices with kubectl, noting when each is first seen
    (and first Ready). kubectl does the decoding, so the bench's own CPU stays out of the way."""

    def __init__(self, kubectl: Path, env: dict[str, str]) -> None:
        self.kubectl = kubectl
        self.env = env
        self.deployments: dict[str, float] = {}
        self.available: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen[str]] = []

    def _follow(self, args: list[str], on_line: Callable[[str], None]) -> threading.Thread:
        proc = subprocess.Popen(
            [str(self.kubectl), "get", "-n", NAMESPACE, "--watch", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.procs.append(proc)

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                on_line(line.strip())

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        return thread

    def _deployment(self, line: str) -> None:
        name, _, available = line.partition(" ")
        name = name.removesuffix("-stable")
        now = time.monotonic()
        with self.lock:
            self.deployments.setdefault(name, now)
            if available not in ("", "0"):
                self.available.setdefault(name, now)

    def _isvc(self, line: str) -> None:
        name, _, ready = line.partition(" ")
        if ready == "True":
            with self.lock:
                self.ready.setdefault(name, time.monotonic())

    def start(self, inference_services: bool) -> None:
        deployments = '{.metadata.name} {.status.availableReplicas}{"\\n"}'
        self._follow(["deployments", "-o", f"jsonpath={deployments}"], self._deployment)
        if inference_services:
            ready = '{.metadata.name} {.status.conditions[?(@.type=="Ready")].status}{"\\n"}'
            self._follow(["inferenceservices", "-o", f"jsonpath={ready}"], self._isvc)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            proc.wait()


def isvc(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "ladle.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": f"svc-{index:04d}", "namespace": NAMESPACE},
        "spec": {
            "model": {"name": "smollm2"},
            "gpuPool": "bench",
            "replicas": 1,
            "resources": {"gpus": 1, "cpu": "1", "memory": "4Gi"},
        },
    }


def run(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    options = Options(nodes=args.nodes, gpus_per_node=8, timeout=600)
    print(f"starting a cluster with {args.nodes} fake GPU nodes ...", flush=True)
    cluster = Cluster(state_dir / "cluster")
    cluster.up(options)
    try:
        handle = KubeCluster(cluster, build.bin_dir())
        recorder = Recorder(handle.kubectl, handle.env())
        helm = subprocess.run(
            [str(handle.helm), "upgrade", "--install", "ladle", str(ROOT / "charts" / "ladle"),
             "--namespace", SYSTEM, "--create-namespace", "--set", "replicas=0", "--wait"],
            env=handle.env(), capture_output=True, text=True, check=False,
        )  # fmt: skip
        if helm.returncode != 0:
            raise SystemExit(helm.stderr)
        with handle.api_client() as api:
            if args.baseline:
                return measure(args, api, None, recorder)
            kubeconfig = handle.service_account_kubeconfig(
                SYSTEM, "ladle", state_dir / "sa.kubeconfig"
            )
            operator = OperatorProcess(
                kubeconfig,
                state_dir / "operator.log",
                lease_namespace=SYSTEM,
                lease="ladle-operator",
                identity="bench",
                extra_args=["--log-level", "WARNING", *args.operator_args],
            )
            try:
                operator.wait_leading()
                return measure(args, api, operator, recorder)
            finally:
                operator.stop()
    finally:
        cluster.down()


def create_at_rate(
    count: int, rate: float, create: Callable[[int], None]
) -> tuple[dict[int, float], dict[int, float]]:
    """Open-loop arrivals: request i is sent at i/rate seconds whatever earlier ones take.

    Returns when each request was sent and when its answer came back."""
    sent: dict[int, float] = {}
    answered: dict[int, float] = {}

    def timed(index: int) -> None:
        create(index)
        answered[index] = time.monotonic()

    with ThreadPoolExecutor(max_workers=32) as pool:
        futures = []
        first = time.monotonic()
        for index in range(count):
            time.sleep(max(0.0, first + index / rate - time.monotonic()))
            sent[index] = time.monotonic()
            futures.append(pool.submit(timed, index))
        for future in futures:
            future.result()
    return sent, answered


def measure(
    args: argparse.Namespace,
    api: ApiClient,
    operator: OperatorProcess | None,
    recorder: Recorder,
) -> dict[str, Any]:
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    apps = client.AppsV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
    custom.create_cluster_custom_object(
        "ladle.dev", "v1alpha1", "gpupools",
        {"apiVersion": "ladle.dev/v1alpha1", "kind": "GPUPool", "metadata": {"name": "bench"},
         "spec": {"nodeSelector": {"nvidia.com/gpu.present": "true"}}},
    )  # fmt: skip
    wait_until(
        lambda: core.read_namespaced_service_account("default", NAMESPACE),
        "the bench namespace's default ServiceAccount",
    )
    recorder.start(inference_services=operator is not None)
    time.sleep(2.0)  # let the watches establish

    def create_isvc(index: int) -> None:
        custom.create_namespaced_custom_object(
            "ladle.dev", "v1alpha1", NAMESPACE, "inferenceservices", isvc(index)
        )

    def create_children(index: int) -> None:
        # What the operator would create, posted directly: the cluster's own cost.
        body = isvc(index)
        body["metadata"].update(uid="none", generation=1)
        parsed = parse_isvc(body)
        deployment = desired_children(parsed, None, 1, OperatorConfig()).deployment
        service = desired_service(parsed)
        for child in (deployment, service):
            del child["metadata"]["ownerReferences"]
        apps.create_namespaced_deployment(NAMESPACE, deployment)
        core.create_namespaced_service(NAMESPACE, service)

    what = "InferenceServices" if operator else "Deployments and Services (no operator)"
    print(f"creating {args.services} {what} at {args.rate}/s ...", flush=True)
    first = time.monotonic()
    sent_at, answered_at = create_at_rate(
        args.services, args.rate, create_isvc if operator else create_children
    )
    created = time.monotonic() - first
    print(f"created in {created:.1f}s; waiting for Ready ...", flush=True)
    done = recorder.ready if operator else recorder.available

    def all_done() -> bool:
        with recorder.lock:
            return len(done) >= args.services

    try:
        wait_until(all_done, "every one to be Ready", timeout=args.timeout)
    except TimeoutError as err:
        print(err, file=sys.stderr)
    recorder.stop()

    with recorder.lock:
        sent = {f"svc-{i:04d}": t for i, t in sent_at.items()}
        latencies = [
            recorder.deployments[n] - t for n, t in sent.items() if n in recorder.deployments
        ]
        # The create request's own share of that, which the API server spends before any
        # controller can see the object.
        requests = [answered_at[i] - t for i, t in sent_at.items()]
        ready_at = max(done.values()) - first if done else float("nan")
        ready_count = len(done)
    result: dict[str, Any] = {
        "apiserver_top_requests": apiserver_costs(recorder),
        "mode": "operator" if operator else "baseline",
        "services": args.services,
        "nodes": args.nodes,
        "rate_per_second": args.rate,
        "create_seconds": round(created, 2),
        "deployments_seen": len(latencies),
        "apply_to_deployment_p50_seconds": round(percentile(latencies, 50), 3),
        "apply_to_deployment_p99_seconds": round(percentile(latencies, 99), 3),
        "apply_to_deployment_max_seconds": round(max(latencies), 3),
        "create_request_p50_seconds": round(percentile(requests, 50), 3),
        "create_request_p99_seconds": round(percentile(requests, 99), 3),
        "ready": ready_count,
        "all_ready_seconds": round(ready_at, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if operator is not None:
        cpu = psutil.Process(operator.pid).cpu_times()
        result.update(
            {
                "operator_peak_rss_mb": round(operator.peak_rss_bytes() / 2**20, 1),
                "operator_cpu_seconds": round(cpu.user + cpu.system, 1),
                "reconciles": operator.metric("ladle_operator_reconcile_total"),
                "reconcile_errors": operator.metric("ladle_operator_reconcile_errors_total"),
                "applies": operator.metric("ladle_operator_applies_total"),
                "urgent_queue_wait_mean_seconds": mean(
                    operator, "ladle_operator_workqueue_wait_seconds", lane="urgent"
                ),
                "isvc_reconcile_mean_seconds": mean(
                    operator, "ladle_operator_reconcile_duration_seconds", kind="isvc"
                ),
                "apply_request_mean_seconds": mean(
                    operator, "ladle_operator_api_request_duration_seconds", method="PATCH"
                ),
            }
        )
    return result


def apiserver_costs(recorder: Recorder, top: int = 8) -> list[str]:
    """The API server's own view: which requests took its time (count, mean, total)."""
    raw = subprocess.run(
        [str(recorder.kubectl), "get", "--raw", "/metrics"],
        env=recorder.env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    totals: dict[tuple[str, ...], list[float]] = {}
    for line in raw.splitlines():
        if not line.startswith("apiserver_request_duration_seconds_"):
            continue
        series, value = line.rsplit(" ", 1)
        part = series.removeprefix("apiserver_request_duration_seconds_").split("{", 1)[0]
        if part not in ("sum", "count"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', series))
        if labels.get("verb") in ("WATCH", "CONNECT"):
            continue
        key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
        slot = totals.setdefault(key, [0.0, 0.0])
        slot[0 if part == "sum" else 1] += float(value)
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [
        f"{verb} {resource}{'/' + sub if sub else ''}: {count:.0f} requests, "
        f"mean {1000 * total / count:.0f} ms, total {total:.1f} s"
        for (verb, resource, sub), (total, count) in ranked
        if count
    ]


def mean(operator: OperatorProcess, histogram: str, **labels: str) -> float:
    total = operator.metric(f"{histogram}_sum", **labels) or 0.0
    count = operator.metric(f"{histogram}_count", **labels) or 0.0
    return round(total / count, 3) if count else float("nan")


def report(result: dict[str, Any]) -> bool:
    ok = result["ready"] == result["services"]
    what = "InferenceServices" if result["mode"] == "operator" else "Deployments, no operator"
    print(
        f"\n{result['services']} {what} on {result['nodes']} nodes x 8 GPUs at "
        f"{result['rate_per_second']}/s: {result['ready']} Ready "
        f"(load average {result['load_average_1m']})"
    )
    checks: list[tuple[str, float, str, float | None]] = [
        ("p50 apply -> Deployment", result["apply_to_deployment_p50_seconds"], "s", None),
        ("p99 apply -> Deployment", result["apply_to_deployment_p99_seconds"], "s",
         TARGET_P99_SECONDS),
        ("all Ready after first apply", result["all_ready_seconds"], "s",
         TARGET_ALL_READY_SECONDS),
    ]  # fmt: skip
    if result["mode"] == "operator":
        checks[2:2] = [
            ("  of which the create request, p50", result["create_request_p50_seconds"], "s", None),
            ("  of which the create request, p99", result["create_request_p99_seconds"], "s", None),
        ]
        checks.append(("operator peak RSS", result["operator_peak_rss_mb"], "MB", TARGET_RSS_MB))
    for label, value, unit, target in checks:
        verdict = "" if target is None else ("PASS" if value < target else "FAIL")
        goal = "" if target is None else f"(target < {target:g} {unit})"
        print(f"  {label:36s} {value:8.3f} {unit:2s} {goal:22s} {verdict}")
        ok = ok and (target is None or value < target)
    if result["mode"] == "operator":
        print(
            f"  reconciles={result['reconciles']:.0f} errors={result['reconcile_errors'] or 0:.0f}"
            f" applies={result['applies']:.0f} operator CPU={result['operator_cpu_seconds']}s"
        )
        print(
            f"  mean urgent queue wait {result['urgent_queue_wait_mean_seconds']}s, mean "
            f"InferenceService reconcile {result['isvc_reconcile_mean_seconds']}s, mean apply "
            f"request {result['apply_request_mean_seconds']}s"
        )
    print("  API server time by request (top):")
    for line in result["apiserver_top_requests"]:
        print(f"    {line}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--rate", type=float, default=10.0, help="creates per second")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for Ready")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--operator-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `ladle operator` flags (last on the line), e.g. --workers 32",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="no operator: create the same Deployments and Services directly, to measure the "
        "cluster's own share",
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="repeat, each on a fresh cluster (default: 1)"
    )
    parser.add_argument(
        "--with-baseline",
        action="store_true",
        help="alternate a --baseline run before each operator run",
    )
    args = parser.parse_args()
    if build.missing():
        raise SystemExit("cluster binaries missing: run `ladle cluster build`")
    modes = [True, False] if args.with_baseline else [args.baseline]
    results: list[dict[str, Any]] = []
    ok = True
    for index in range(args.runs):
        for baseline in modes:
            print(f"\n== run {index + 1}/{args.runs}: {'baseline' if baseline else 'operator'}")
            with tempfile.TemporaryDirectory(prefix="ladle-bench-") as tmp:
                result = run(argparse.Namespace(**{**vars(args), "baseline": baseline}), Path(tmp))
            ok = report(result) and ok
            results.append(result)
    if len(results) > 1:
        summarize(results)
    if args.json:
        args.json.write_text(json.dumps(results if len(results) > 1 else results[0], indent=2))
    return 0 if ok else 1


SUMMARY = (
    ("apply_to_deployment_p50_seconds", "p50 apply -> Deployment (s)", None),
    ("apply_to_deployment_p99_seconds", "p99 apply -> Deployment (s)", TARGET_P99_SECONDS),
    ("all_ready_seconds", "all Ready after first apply (s)", TARGET_ALL_READY_SECONDS),
    ("operator_peak_rss_mb", "operator peak RSS (MB)", TARGET_RSS_MB),
    ("operator_cpu_seconds", "operator CPU (s)", None),
)


def summarize(results: list[dict[str, Any]]) -> None:
    """Median and range of each measure, per mode, beside the targets."""
    print("\nmedian [min-max] over runs")
    print(f"  {'measure':34s} {'operator':>24s} {'baseline':>24s}  target")
    for key, label, target in SUMMARY:
        cells = []
        for mode in ("operator", "baseline"):
            values = sorted(r[key] for r in results if r["mode"] == mode and key in r)
            if values:
                median = statistics.median(values)
                cells.append(f"{median:.3g} [{values[0]:.3g}-{values[-1]:.3g}]")
            else:
                cells.append("")
        goal = f"< {target:g}" if target is not None else ""
        print(f"  {label:34s} {cells[0]:>24s} {cells[1]:>24s}  {goal}")


if __name__ == "__main__":
    sys.exit(main())
