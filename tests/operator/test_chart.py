"""The Helm chart: lint, server-side dry run, install/upgrade/uninstall, and least privilege."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from kube_harness import Kube, wait_until

from ladle_dev.pytest_plugin import KubeCluster

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "ladle"


def helm(cluster: KubeCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cluster.helm), *args],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_helm_lint_passes_strictly(k8s_cluster: KubeCluster) -> None:
    result = helm(k8s_cluster, "lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_rendered_chart_passes_a_server_side_dry_run(
    k8s_cluster: KubeCluster, kube: Kube, k8s_namespace: str
) -> None:
    rendered = helm(
        k8s_cluster, "template", "dry", str(CHART), "--namespace", k8s_namespace,
        "--include-crds", "--kube-version", "1.34.0",
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    applied = kube.kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered.stdout)
    assert applied.returncode == 0, applied.stderr
    kinds = {line.split("/")[0] for line in applied.stdout.splitlines()}
    assert {
        "customresourcedefinition.apiextensions.k8s.io",
        "serviceaccount",
        "clusterrole.rbac.authorization.k8s.io",
        "clusterrolebinding.rbac.authorization.k8s.io",
        "role.rbac.authorization.k8s.io",
        "rolebinding.rbac.authorization.k8s.io",
        "deployment.apps",
        "service",
        "poddisruptionbudget.policy",
    } <= kinds


def test_install_upgrade_and_uninstall(
    k8s_cluster: KubeCluster, kube: Kube, k8s_namespace: str
) -> None:
    release = "ladle-chart-test"
    installed = helm(
        k8s_cluster, "install", release, str(CHART), "--namespace", k8s_namespace,
        "--wait", "--timeout", "120s",
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    dep = kube.apps.read_namespaced_deployment(release, k8s_namespace)
    assert dep.spec.replicas == 2
    assert dep.status.available_replicas == 2  # kwok runs the pods on the fake nodes
    env = {e.name: e.value for e in dep.spec.template.spec.containers[0].env}
    assert env["LADLE_OPERATOR_LEADER_ELECT"] == "true"
    # Every variable follows the one rule: LADLE_OPERATOR_ and an `ladle operator` flag.
    from ladle.cli import build_parser
    from ladle.settings import env_name, leaf_parsers

    operator_cli = dict(leaf_parsers(build_parser()))["operator"]
    flags = [f for a in operator_cli._actions for f in a.option_strings if f.startswith("--")]
    names = {e.name for e in dep.spec.template.spec.containers[0].env}
    assert names <= {env_name("operator", f) for f in flags}
    assert env["LADLE_OPERATOR_RUNTIME_IMAGE"] == "ghcr.io/ladle-dev/ladle-runtime:0.1.0"
    gateway = f"{release}-gateway"
    assert env["LADLE_OPERATOR_GATEWAY_URL"] == (
        f"http://{gateway}.{k8s_namespace}.svc.cluster.local/v1"
    )
    assert kube.policy.read_namespaced_pod_disruption_budget(release, k8s_namespace)
    gw = kube.apps.read_namespaced_deployment(gateway, k8s_namespace)
    assert (gw.spec.replicas, gw.status.available_replicas) == (2, 2)
    gw_pod = gw.spec.template.spec
    assert gw_pod.containers[0].command == ["ladle", "gateway"]
    assert gw_pod.service_account_name == gateway
    assert kube.policy.read_namespaced_pod_disruption_budget(gateway, k8s_namespace)
    assert kube.core.read_namespaced_service(gateway, k8s_namespace).spec.ports[0].port == 80

    upgraded = helm(
        k8s_cluster, "upgrade", release, str(CHART), "--namespace", k8s_namespace,
        "--set", "logLevel=DEBUG", "--set", "workers=4", "--wait", "--timeout", "120s",
    )  # fmt: skip
    assert upgraded.returncode == 0, upgraded.stderr
    dep = kube.apps.read_namespaced_deployment(release, k8s_namespace)
    env = {e.name: e.value for e in dep.spec.template.spec.containers[0].env}
    assert (env["LADLE_OPERATOR_LOG_LEVEL"], env["LADLE_OPERATOR_WORKERS"]) == ("DEBUG", "4")
    history = json.loads(
        helm(k8s_cluster, "history", release, "-n", k8s_namespace, "-o", "json").stdout
    )
    assert [h["revision"] for h in history] == [1, 2]

    removed = helm(k8s_cluster, "uninstall", release, "--namespace", k8s_namespace, "--wait")
    assert removed.returncode == 0, removed.stderr
    for kind in ("deployment", "serviceaccount", "role", "service"):
        wait_until(
            lambda kind=kind: (
                not kube.kubectl(
                    "get", kind, release, "-n", k8s_namespace, "--ignore-not-found", "-o", "name"
                ).stdout.strip()
            ),
            f"{kind} {release} to be uninstalled",
        )
    assert not kube.kubectl("get", "clusterrole", release, "--ignore-not-found").stdout
    # CRDs outlive the release: deleting them would delete every InferenceService.
    assert kube.kubectl("get", "crd", "inferenceservices.ladle.dev").returncode == 0


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("watch", "inferenceservices.ladle.dev", True),
        ("patch", "inferenceservices.ladle.dev --subresource=status", True),
        ("patch", "gpupools.ladle.dev --subresource=status", True),
        ("patch", "deployments.apps", True),
        ("create", "deployments.apps", True),  # server-side apply that creates
        ("delete", "configmaps", True),
        ("delete", "poddisruptionbudgets.policy", True),
        ("list", "events", True),
        ("create", "events", True),
        ("patch", "events", True),  # a repeated event is counted on the first
        ("watch", "nodes", True),
        ("watch", "namespaces", True),  # GPUPool namespaceSelectors
        ("patch", "gpupools.ladle.dev", True),  # its finalizer, by server-side apply
        # Removes the ladle.dev/rollout-action annotation once done; deletes a canary's
        # Deployment when its rollout ends.
        ("patch", "inferenceservices.ladle.dev", True),
        ("delete", "deployments.apps", True),
        # A group's workers, its headless Service (gone when replicas fit a node again), and
        # the Secret its ranks share, created once and never read back.
        ("patch", "statefulsets.apps", True),
        ("delete", "services", True),
        ("create", "secrets", True),
        # What it must not do:
        ("update", "inferenceservices.ladle.dev", False),
        ("delete", "inferenceservices.ladle.dev", False),
        ("update", "deployments.apps", False),
        ("create", "pods", False),
        ("delete", "pods", False),
        ("get", "secrets", False),
        ("list", "secrets", False),
        ("patch", "secrets", False),
        ("delete", "statefulsets.apps", False),
        ("patch", "nodes", False),
        ("update", "gpupools.ladle.dev", False),
        ("delete", "gpupools.ladle.dev", False),
        ("patch", "namespaces", False),
        ("create", "customresourcedefinitions.apiextensions.k8s.io", False),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", False),
    ],
)
def test_operator_service_account_has_only_what_it_needs(
    kube: Kube, ladle_chart: str, verb: str, resource: str, allowed: bool
) -> None:
    answer = kube.kubectl(
        "auth", "can-i", verb, *resource.split(), "--all-namespaces",
        f"--as=system:serviceaccount:{ladle_chart}:ladle",
    )  # fmt: skip
    assert answer.stdout.strip() == ("yes" if allowed else "no")


def test_leader_election_is_limited_to_its_own_lease(kube: Kube, ladle_chart: str) -> None:
    who = f"--as=system:serviceaccount:{ladle_chart}:ladle"

    def can(*args: str) -> str:
        return kube.kubectl("auth", "can-i", *args, who, "-n", ladle_chart).stdout.strip()

    assert can("update", "leases.coordination.k8s.io/ladle-operator") == "yes"
    assert can("update", "leases.coordination.k8s.io/someone-else") == "no"
    assert can("create", "leases.coordination.k8s.io") == "yes"
    assert (
        kube.kubectl(
            "auth", "can-i", "create", "leases.coordination.k8s.io", who, "-n", "default"
        ).stdout.strip()
        == "no"
    )
