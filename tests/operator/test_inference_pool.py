"""The Gateway API Inference Extension's InferencePool and the Gateway API's HTTPRoute, on the
real API server with the CRDs from the pinned modules: absent CRDs cost one log line each and
no object; present ones give each InferenceService a pool that selects its pods, and a route to
it from the Gateway it names, kept like any other child.

The tests run in order: the first removes the CRDs (a standing cluster may have them from an
earlier run), the second installs them, as a cluster admin would after Ladle."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kube_harness import Kube, OperatorFactory, gone, isvc_manifest, wait_until

from ladle_dev.cluster import gaie

pytestmark = pytest.mark.cluster

CRD = "inferencepools.inference.networking.k8s.io"
ROUTE_CRD = "httproutes.gateway.networking.k8s.io"
REWRITE_CRD = "inferencemodelrewrites.inference.networking.x-k8s.io"


def pool(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    shown = kube.kubectl("get", "-n", namespace, "inferencepool", name, "-o", "json")
    return json.loads(shown.stdout) if shown.returncode == 0 else None


def test_without_the_crds_no_pool_is_made_and_one_line_says_so(
    kube: Kube, k8s_namespace: str, operator_factory: OperatorFactory
) -> None:
    removed = kube.kubectl(
        "delete", "crd", CRD, ROUTE_CRD, REWRITE_CRD, "--ignore-not-found", "--wait=true"
    )
    assert removed.returncode == 0, removed.stderr
    op = operator_factory("inference-pool-absent")
    op.wait_leading()
    kube.apply(
        isvc_manifest("chat", inferencePool={"gateway": {"name": "inference"}}), k8s_namespace
    )
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    for plural in ("inferencepools", "httproutes", "inferencemodelrewrites"):
        said = [line for line in op.log.read_text().splitlines() if plural in line]
        assert len(said) == 1, said
        assert f"does not serve {plural}" in said[0]
        assert "restart the operator" in said[0]
    assert kube.kubectl("get", "crd", CRD).returncode != 0
    op.stop()


def test_each_service_gets_a_pool_of_its_pods_kept_and_collected_with_it(
    kube: Kube, k8s_namespace: str, operator_factory: OperatorFactory
) -> None:
    crds = (gaie.POOL_CRD, gaie.MODEL_REWRITE_CRD)
    for path in (*(gaie.module_dir() / crd for crd in crds), gaie.http_route_crd()):
        installed = kube.kubectl("apply", "--server-side", "-f", str(path))
        assert installed.returncode == 0, installed.stderr
    # kubectl wait errs rather than waits while a new CRD has no conditions yet.
    wait_until(
        lambda: (
            kube.kubectl(
                "wait",
                "--for=condition=Established",
                f"crd/{CRD}",
                f"crd/{ROUTE_CRD}",
                f"crd/{REWRITE_CRD}",
                "--timeout=5s",
            ).returncode
            == 0
        ),
        "the CRDs to be Established",
    )
    op = operator_factory("inference-pool-present")
    op.wait_leading()
    kube.apply(
        isvc_manifest("chat", replicas=2, inferencePool={"endpointPicker": {"port": 9003}}),
        k8s_namespace,
    )
    obj = kube.wait_condition(k8s_namespace, "chat", "Ready")
    made = wait_until(lambda: pool(kube, k8s_namespace, "chat"), "the InferencePool")
    assert made["spec"] == {
        "selector": {"matchLabels": {"ladle.dev/inferenceservice": "chat"}},
        "targetPorts": [{"number": 8000}],
        "appProtocol": "http",
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": "chat-epp",
            "port": {"number": 9003},
            "failureMode": "FailClose",
        },
    }
    (owner,) = made["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "InferenceService",
        "chat",
        obj["metadata"]["uid"],
    )
    # The pool selects exactly the service's pods, which is what an endpoint picker serves.
    selector = ",".join(f"{k}={v}" for k, v in made["spec"]["selector"]["matchLabels"].items())
    pods = kube.core.list_namespaced_pod(k8s_namespace, label_selector=selector).items
    assert len(pods) == 2
    listed = kube.kubectl("get", "-n", k8s_namespace, "inferencepools", "-o", "name")
    assert listed.stdout.split() == ["inferencepool.inference.networking.k8s.io/chat"]

    # No Gateway named, no route.
    assert gone(kube, "-n", k8s_namespace, "httproute/chat")

    deleted = kube.kubectl("delete", "-n", k8s_namespace, "inferencepool/chat", "--wait=true")
    assert deleted.returncode == 0, deleted.stderr
    wait_until(
        lambda: not gone(kube, "-n", k8s_namespace, "inferencepool/chat"),
        "the deleted InferencePool to be recreated",
    )
    kube.wait_event(k8s_namespace, "chat", "Normal", "Restored")

    removed = kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "chat", "--wait=true")
    assert removed.returncode == 0, removed.stderr
    wait_until(
        lambda: gone(kube, "-n", k8s_namespace, "inferencepool/chat"),
        "the InferencePool to be garbage-collected with its service",
    )
    op.stop()


def route(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    shown = kube.kubectl("get", "-n", namespace, "httproute", name, "-o", "json")
    return json.loads(shown.stdout) if shown.returncode == 0 else None


def test_a_named_gateway_gets_an_http_route_to_the_pool_which_goes_with_the_name(
    kube: Kube, k8s_namespace: str, operator_factory: OperatorFactory
) -> None:
    """Runs after the CRDs are installed (the test above)."""
    op = operator_factory("inference-pool-route")
    op.wait_leading()
    gateway = {"name": "inference", "namespace": "gateways", "sectionName": "http"}
    kube.apply(isvc_manifest("chat", inferencePool={"gateway": gateway}), k8s_namespace)
    made = wait_until(lambda: route(kube, k8s_namespace, "chat"), "the HTTPRoute")
    spec = made["spec"]
    assert spec["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference",
         "namespace": "gateways", "sectionName": "http"}
    ]  # fmt: skip
    (rule,) = spec["rules"]
    (match,) = rule["matches"]
    assert match["headers"] == [
        {"type": "Exact", "name": "X-Gateway-Model-Name", "value": "smollm2"}
    ]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        "chat",
    )
    assert pool(kube, k8s_namespace, "chat") is not None
    # The service stops naming a Gateway: its route goes, its pool stays.
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    wait_until(
        lambda: gone(kube, "-n", k8s_namespace, "httproute/chat"), "the HTTPRoute to be deleted"
    )
    assert pool(kube, k8s_namespace, "chat") is not None
    op.stop()


def backends(kube: Kube, namespace: str, name: str) -> list[tuple[str, int]] | None:
    made = route(kube, namespace, name)
    if made is None:
        return None
    (rule,) = made["spec"]["rules"]
    return [(b["name"], b["weight"]) for b in rule["backendRefs"]]


def test_pools_per_variant_carry_a_canary_rollouts_weights_in_the_route(
    kube: Kube, k8s_namespace: str, operator_factory: OperatorFactory
) -> None:
    """A GAIE gateway splits traffic by the route's backendRef weights, and each pool's picker
    chooses among that variant's pods only: so the canary's steps hold behind it."""
    op = operator_factory("inference-pool-variants")
    op.wait_leading()
    spec: dict[str, Any] = {
        "replicas": 2,
        "inferencePool": {"perVariant": True, "gateway": {"name": "inference"}},
        "rollout": {
            "steps": [25, 100],
            "intervalSeconds": 3600,
            "progressDeadlineSeconds": 7200,
            "analysis": {"quality": {"enabled": False}},
        },
    }
    kube.apply(isvc_manifest("split", **spec), k8s_namespace)
    kube.wait_condition(k8s_namespace, "split", "Ready")
    stable = [("split-stable", 100)]
    wait_until(lambda: backends(kube, k8s_namespace, "split") == stable, "the stable route")
    # The pools are applied beside the route, in no set order.
    made = wait_until(lambda: pool(kube, k8s_namespace, "split-stable"), "the stable's pool")
    assert made["spec"]["selector"]["matchLabels"] == {
        "ladle.dev/inferenceservice": "split",
        "ladle.dev/variant": "stable",
    }
    assert made["spec"]["endpointPickerRef"]["name"] == "split-epp-stable"
    wait_until(lambda: pool(kube, k8s_namespace, "split"), "the service's own pool, kept too")
    assert gone(kube, "-n", k8s_namespace, "inferencepool/split-canary")

    kube.apply(isvc_manifest("split", quantization={"weights": "int8"}, **spec), k8s_namespace)
    split = [("split-stable", 75), ("split-canary", 25)]
    wait_until(lambda: backends(kube, k8s_namespace, "split") == split, "the route at 25%", 120)
    canary = wait_until(lambda: pool(kube, k8s_namespace, "split-canary"), "the canary's pool")
    labels = canary["spec"]["selector"]["matchLabels"]
    assert labels["ladle.dev/variant"] == "canary"
    assert canary["spec"]["endpointPickerRef"]["name"] == "split-epp-canary"
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = kube.core.list_namespaced_pod(k8s_namespace, label_selector=selector).items
    assert [p.metadata.labels["ladle.dev/variant"] for p in pods] == ["canary"]
    # Status is written after the children are applied.
    weights = [{"variant": "stable", "weight": 75}, {"variant": "canary", "weight": 25}]
    wait_until(
        lambda: kube.isvc(k8s_namespace, "split")["status"]["rollout"].get("weights") == weights,
        "the weights in status",
    )

    # Rolled back: the canary's pool goes with its pods, and the route is all stable's again.
    annotated = kube.kubectl(
        "annotate", "-n", k8s_namespace, "lisvc", "split", "ladle.dev/rollout-action=abort"
    )
    assert annotated.returncode == 0, annotated.stderr
    wait_until(lambda: backends(kube, k8s_namespace, "split") == stable, "the route back", 120)
    wait_until(
        lambda: gone(kube, "-n", k8s_namespace, "inferencepool/split-canary"),
        "the canary's pool to be deleted",
    )
    op.stop()


def test_a_service_with_no_replica_available_routes_to_its_fallback_under_its_model(
    kube: Kube, k8s_namespace: str, operator_factory: OperatorFactory
) -> None:
    """A GAIE gateway has no breaker: while none of a service's replicas is available, the
    operator routes its model to the fallback's pool, and GAIE's model rewrite there renames
    the requests to the model the fallback's pods serve."""
    op = operator_factory("inference-pool-fallback")
    op.wait_leading()
    gateway = {"name": "inference"}
    kube.apply(
        isvc_manifest("backup", model={"name": "backup-model"}, inferencePool={"gateway": gateway}),
        k8s_namespace,
    )
    kube.apply(
        isvc_manifest(
            "primary", fallback="backup", minReplicas=0, inferencePool={"gateway": gateway}
        ),
        k8s_namespace,
    )
    kube.wait_condition(k8s_namespace, "primary", "Ready")
    own = [("primary", None)]
    wait_until(lambda: targets(kube, k8s_namespace, "primary") == own, "the route to its pool")

    def rewrite_spec() -> dict[str, Any] | None:
        shown = kube.kubectl(
            "get", "-n", k8s_namespace, "inferencemodelrewrite", "primary-fallback", "-o", "json"
        )
        return json.loads(shown.stdout)["spec"] if shown.returncode == 0 else None

    # Made once the operator knows the fallback, which may come after the first reconcile.
    rewrite = wait_until(rewrite_spec, "the model rewrite")
    assert rewrite["poolRef"]["name"] == "backup"
    (rule,) = rewrite["rules"]
    assert rule["matches"] == [{"model": {"type": "Exact", "value": "smollm2"}}]
    assert rule["targets"] == [{"modelRewrite": "backup-model"}]

    scaled = kube.kubectl("scale", "-n", k8s_namespace, "lisvc", "primary", "--replicas=0")
    assert scaled.returncode == 0, scaled.stderr
    fallen = [("backup", "backup")]
    wait_until(lambda: targets(kube, k8s_namespace, "primary") == fallen, "the fallback route")
    scaled = kube.kubectl("scale", "-n", k8s_namespace, "lisvc", "primary", "--replicas=1")
    assert scaled.returncode == 0, scaled.stderr
    wait_until(lambda: targets(kube, k8s_namespace, "primary") == own, "the route back")

    # No fallback named, no rewrite.
    kube.apply(
        isvc_manifest("primary", minReplicas=0, inferencePool={"gateway": gateway}), k8s_namespace
    )
    wait_until(
        lambda: gone(kube, "-n", k8s_namespace, "inferencemodelrewrite/primary-fallback"),
        "the rewrite to be deleted",
    )
    op.stop()


def targets(kube: Kube, namespace: str, name: str) -> list[tuple[str, str | None]] | None:
    """Each backend of a route's rule, and the fallback its answers name (None: none)."""
    made = route(kube, namespace, name)
    if made is None:
        return None
    (rule,) = made["spec"]["rules"]
    found = []
    for backend in rule["backendRefs"]:
        named = [
            h["value"]
            for f in backend.get("filters", ())
            for h in f["responseHeaderModifier"]["set"]
            if h["name"] == "x-ladle-fallback"
        ]
        found.append((backend["name"], named[0] if named else None))
    return found
