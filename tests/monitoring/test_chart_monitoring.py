"""The chart with every monitoring object on passes a server-side dry run against the real
Prometheus operator CRDs (vendored in crds/), installed into the local cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ladle_dev.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
EVERYTHING = (
    "monitoring.prometheusRule.enabled=true",
    "monitoring.dashboard.enabled=true",
    *(
        f"monitoring.{kind}.{component}.enabled=true"
        for kind in ("podMonitors", "serviceMonitors")
        for component in ("runtime", "gateway", "operator")
    ),
    "monitoring.labels.release=kube-prometheus-stack",
)


def test_the_chart_with_all_monitoring_on_passes_a_server_side_dry_run(
    k8s_cluster: KubeCluster, k8s_namespace: str, helm_template: Any
) -> None:
    crds = k8s_cluster.run_kubectl("apply", "--server-side", "-f", str(HERE / "crds"))
    assert crds.returncode == 0, crds.stderr
    names = [
        f"crd/{kind}.monitoring.coreos.com"
        for kind in ("podmonitors", "servicemonitors", "prometheusrules")
    ]
    established = k8s_cluster.run_kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *names
    )
    assert established.returncode == 0, established.stderr
    rendered = helm_template(*EVERYTHING, namespace=k8s_namespace, crds=True)
    assert rendered.returncode == 0, rendered.stderr
    applied = k8s_cluster.run_kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered.stdout)
    assert applied.returncode == 0, applied.stderr
    lines = applied.stdout.splitlines()
    for kind, name in (
        ("prometheusrule.monitoring.coreos.com", "ladle"),
        ("podmonitor.monitoring.coreos.com", "ladle-runtime"),
        ("podmonitor.monitoring.coreos.com", "ladle-gateway"),
        ("podmonitor.monitoring.coreos.com", "ladle-operator"),
        ("servicemonitor.monitoring.coreos.com", "ladle-runtime"),
        ("servicemonitor.monitoring.coreos.com", "ladle-gateway"),
        ("servicemonitor.monitoring.coreos.com", "ladle-operator"),
        ("configmap", "ladle-dashboard"),
    ):
        assert f"{kind}/{name} created (server dry run)" in lines, (kind, name, lines)
