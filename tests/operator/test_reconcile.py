"""The operator against the real cluster, running as a process under the chart's own RBAC.

One operator serves the whole module; each test works in its own namespace. kwok marks runtime
pods Running and Ready, so everything here is about objects, status, events and scheduling.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_harness import Kube, OperatorProcess, gone, isvc_manifest, pool_manifest, wait_until

from ladle.operator.store import PodInfo

# Every test here needs the module's operator running, whether or not it reads from it.
pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("operator")]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "registry.test/ladle-runtime:test"  # the operator's --runtime-image in conftest


def deployment(kube: Kube, namespace: str, name: str) -> Any:
    return kube.apps.read_namespaced_deployment(name, namespace)


def test_every_example_applies_and_becomes_ready(kube: Kube, k8s_namespace: str) -> None:
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    names = []
    try:
        for path in examples:
            kube.apply(path.read_text(), k8s_namespace)
            names += [
                doc["metadata"]["name"]
                for doc in yaml.safe_load_all(path.read_text())
                if doc and doc["kind"] == "InferenceService"
            ]
        assert len(names) >= 4
        for name in names:
            obj = kube.wait_condition(k8s_namespace, name, "Ready", timeout=90)
            assert kube.condition(obj, "Degraded")["status"] == "False"
            assert obj["status"]["availableReplicas"] == obj["spec"]["replicas"]
        pool = wait_until(
            lambda: (p := kube.pool("h200")).get("status", {}).get("claimed") == 4 and p,
            "GPUPool h200 to count the examples' 4 GPUs",
        )
        assert pool["status"]["nodes"] >= 1
        assert kube.condition(pool, "Ready")["status"] == "True"
    finally:
        kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "--all", "--wait=false")
        kube.kubectl("delete", "gpupool", "h200", "--wait=false")
        kube.kubectl("delete", "-n", k8s_namespace, "pvc", "--all", "--wait=false")
        kube.kubectl("delete", "pv", "ladle-example-models", "--wait=false")


def test_children_are_complete_and_status_is_kubernetes_grade(
    kube: Kube, k8s_namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(isvc_manifest("chat", replicas=2, resources={"gpus": 1, "cpu": 1}), k8s_namespace)
    obj = kube.wait_condition(k8s_namespace, "chat", "Ready", reason="Available")
    status = obj["status"]
    assert status["url"] == f"http://chat.{k8s_namespace}.svc.cluster.local/v1"
    assert status["selector"] == "ladle.dev/inferenceservice=chat"
    assert (status["replicas"], status["readyReplicas"], status["availableReplicas"]) == (2, 2, 2)
    # The revision is a digest of what the pods run (canary rollouts compare them).
    assert re.fullmatch(r"[0-9a-f]{10}", status["variants"][0].pop("revision"))
    assert status["variants"] == [
        {
            "name": "stable",
            "weight": 100,
            "quantization": "none",
            "image": IMAGE,
            "deployment": "chat-stable",
            "requestedReplicas": 2,
            "desiredReplicas": 2,
            "replicas": 2,
            "readyReplicas": 2,
            "availableReplicas": 2,
            "updatedReplicas": 2,
        }
    ]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True",
        "Progressing": "False",
        "Reconciling": "False",
        "Stalled": "False",
        "Degraded": "False",
    }

    dep = deployment(kube, k8s_namespace, "chat-stable")
    owner = dep.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == (
        "InferenceService",
        "chat",
        obj["metadata"]["uid"],
        True,
    )
    container = dep.spec.template.spec.containers[0]
    assert container.image == IMAGE
    assert container.resources.limits == {"nvidia.com/gpu": "1"}
    pods = kube.core.list_namespaced_pod(k8s_namespace, label_selector=status["selector"]).items
    assert len(pods) == 2
    assert all(p.spec.node_name and p.spec.node_name.startswith("ladle-gpu-") for p in pods)
    # The autoscaler learns a pace per pod template: each pod names the ReplicaSet it runs in.
    (replica_set,) = kube.apps.list_namespaced_replica_set(
        k8s_namespace, label_selector=status["selector"]
    ).items
    serialize = kube.core.api_client.sanitize_for_serialization
    infos = [PodInfo.from_pod(serialize(p)) for p in pods]
    assert {info.replica_set for info in infos} == {replica_set.metadata.name}
    # And it projects a rising load over how long a pod took from creation to Ready.
    assert all(info.start_seconds is not None and 0 <= info.start_seconds < 120 for info in infos)
    service = kube.core.read_namespaced_service("chat", k8s_namespace)
    assert service.spec.selector == {"ladle.dev/inferenceservice": "chat"}
    pdb = kube.policy.read_namespaced_pod_disruption_budget("chat-stable", k8s_namespace)
    assert pdb.spec.max_unavailable == 1

    # The operator never writes the user's object, only its status subresource.
    managers = {(f["manager"], f.get("subresource", "")) for f in obj["metadata"]["managedFields"]}
    assert ("ladle-operator", "status") in managers
    assert not any(m == "ladle-operator" and sub != "status" for m, sub in managers)

    table = kube.kubectl("get", "-n", k8s_namespace, "lisvc", "chat", "-o", "wide")
    header, row = table.stdout.splitlines()
    assert header.split() == [
        "NAME", "MODEL", "REPLICAS", "DESIRED", "AVAILABLE", "READY", "DEGRADED", "REASON",
        "ROLLOUT", "CANARY", "POOL", "BREAKER", "URL", "AGE",
    ]  # fmt: skip
    # kubectl aligns the columns and leaves an empty one blank: cut the row where the header's
    # names start.
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    columns = {
        name: row[a:b].strip()
        for name, a, b in zip(header.split(), starts, [*starts[1:], None], strict=True)
    }
    assert {k: columns[k] for k in ("NAME", "MODEL", "REPLICAS", "AVAILABLE", "READY")} == {
        "NAME": "chat", "MODEL": "smollm2", "REPLICAS": "2", "AVAILABLE": "2", "READY": "True"
    }  # fmt: skip
    assert (columns["DEGRADED"], columns["REASON"]) == ("False", "Available")

    kube.wait_event(k8s_namespace, "chat", "Normal", "Ready")
    assert operator.metric("ladle_operator_reconcile_total", kind="isvc", result="ok")


def test_a_spec_edit_rolls_out_without_ready_dropping(kube: Kube, k8s_namespace: str) -> None:
    """maxUnavailable 0 keeps the old replica serving until the new one is available, so
    Ready stays True throughout; Progressing tells of the rollout."""
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    before = deployment(kube, k8s_namespace, "chat-stable")

    def state(obj: dict[str, Any]) -> tuple[int, str, str]:
        return (
            (obj.get("status") or {}).get("observedGeneration", 0),
            kube.condition(obj, "Ready").get("status", ""),
            kube.condition(obj, "Progressing").get("status", ""),
        )

    versions = kube.isvc_versions(k8s_namespace, "chat")
    kube.apply(isvc_manifest("chat", engine={"maxModelLen": 2048}), k8s_namespace)
    obj = kube.wait_condition(k8s_namespace, "chat", "Progressing", "False")
    seen = [state(o) for o in versions.until(obj)]
    generation = obj["metadata"]["generation"]
    assert generation == 2
    after = deployment(kube, k8s_namespace, "chat-stable")
    assert after.metadata.generation > before.metadata.generation
    args = after.spec.template.spec.containers[0].args
    assert args[args.index("--max-model-len") + 1] == "2048"
    assert after.status.updated_replicas == 1
    assert after.spec.strategy.rolling_update.max_unavailable == 0
    # Ready never dropped; the new generation was reported rolling out, then complete.
    assert [s for s in seen if s[1] != "True"] == []
    new = [(ready, progressing) for gen, ready, progressing in seen if gen == generation]
    assert ("True", "True") in new
    assert new[-1] == ("True", "False")
    kube.wait_event(k8s_namespace, "chat", "Normal", "RollingOut")


def test_hand_edits_are_reverted_and_deleted_children_restored(
    kube: Kube, k8s_namespace: str
) -> None:
    kube.apply(isvc_manifest("chat", replicas=2), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")

    patch = {"spec": {"template": {"spec": {"containers": [{"name": "runtime", "image": "evil"}]}}}}
    edited = kube.kubectl(
        "patch", "-n", k8s_namespace, "deployment", "chat-stable", "-p", json.dumps(patch)
    )
    assert edited.returncode == 0, edited.stderr
    scaled = kube.kubectl("scale", "-n", k8s_namespace, "deployment/chat-stable", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    wait_until(
        lambda: (
            (d := deployment(kube, k8s_namespace, "chat-stable")).spec.replicas == 2
            and d.spec.template.spec.containers[0].image == IMAGE
        ),
        "the Deployment's image and replicas to be restored",
    )

    for kind in ("service/chat", "poddisruptionbudget/chat-stable", "deployment/chat-stable"):
        deleted = kube.kubectl("delete", "-n", k8s_namespace, kind, "--wait=true")
        assert deleted.returncode == 0, deleted.stderr
    wait_until(
        lambda: (
            not gone(kube, "-n", k8s_namespace, "service/chat")
            and not gone(kube, "-n", k8s_namespace, "poddisruptionbudget/chat-stable")
            and not gone(kube, "-n", k8s_namespace, "deployment/chat-stable")
        ),
        "the deleted children to be recreated",
    )
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    kube.wait_event(k8s_namespace, "chat", "Normal", "Reverted")
    kube.wait_event(k8s_namespace, "chat", "Normal", "Restored", at_least=3)

    # The same deletion again is the same event again: counted, not repeated.
    uid = kube.core.read_namespaced_service("chat", k8s_namespace).metadata.uid
    kube.kubectl("delete", "-n", k8s_namespace, "service/chat", "--wait=true")
    wait_until(
        lambda: kube.core.read_namespaced_service("chat", k8s_namespace).metadata.uid != uid,
        "the Service to be recreated again",
    )
    restored = "Recreated Service chat, which was deleted outside the operator"

    def restored_events() -> list[Any] | None:
        # Other events (Ready, RollingOut) repeat too; wait on this one's count.
        found = [e for e in kube.event_objects(k8s_namespace, "chat") if e.message == restored]
        return found if any(e.count == 2 for e in found) else None

    events = wait_until(restored_events, "the repeated event to be counted", timeout=20)
    assert [e.count for e in events] == [2]


def test_metadata_drift_is_reverted_and_a_dropped_label_is_not_a_deletion(
    kube: Kube, k8s_namespace: str
) -> None:
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    # Labels and annotations the operator sets count as much as the spec.
    for edit in (
        ["label", "deployment", "chat-stable", "app.kubernetes.io/instance=evil", "--overwrite"],
        ["annotate", "deployment", "chat-stable", "ladle.dev/template-hash-"],
    ):
        done = kube.kubectl(*edit, "-n", k8s_namespace)
        assert done.returncode == 0, done.stderr
    wait_until(
        lambda: (
            (meta := deployment(kube, k8s_namespace, "chat-stable").metadata).labels[
                "app.kubernetes.io/instance"
            ]
            == "chat"
            and "ladle.dev/template-hash" in (meta.annotations or {})
        ),
        "the Deployment's labels and annotations to be put back",
    )
    # Without the managed-by label the Service drops out of the operator's watch, which looks
    # like a deletion; it is the same object, relabelled, and the event says so.
    uid = kube.core.read_namespaced_service("chat", k8s_namespace).metadata.uid
    dropped = kube.kubectl(
        "label", "service", "chat", "app.kubernetes.io/managed-by-", "-n", k8s_namespace
    )
    assert dropped.returncode == 0, dropped.stderr
    service = wait_until(
        lambda: (
            (s := kube.core.read_namespaced_service("chat", k8s_namespace)).metadata.labels.get(
                "app.kubernetes.io/managed-by"
            )
            == "ladle-operator"
            and s
        ),
        "the Service's label to be put back",
    )
    assert service.metadata.uid == uid

    def reverted() -> list[str] | None:
        """The Reverted events once both objects have one (the Deployment's two edits may
        come as two events before the Service's)."""
        messages = [m for _, r, m in kube.events(k8s_namespace, "chat") if r == "Reverted"]
        deployment_told = any("Deployment chat-stable" in m and "label" in m for m in messages)
        service_told = any(m.startswith("Put back the labels of Service chat") for m in messages)
        return messages if deployment_told and service_told else None

    wait_until(reverted, "a Reverted event for the Deployment's labels and one for the Service's")
    assert "Restored" not in [r for _, r, _ in kube.events(k8s_namespace, "chat")]


def test_deleting_an_inference_service_garbage_collects_its_children(
    kube: Kube, k8s_namespace: str
) -> None:
    kube.apply(isvc_manifest("chat", replicas=2), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    assert not gone(kube, "-n", k8s_namespace, "poddisruptionbudget/chat-stable")
    deleted = kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "chat", "--wait=true")
    assert deleted.returncode == 0, deleted.stderr
    for kind in ("deployment/chat-stable", "service/chat", "poddisruptionbudget/chat-stable"):
        wait_until(lambda kind=kind: gone(kube, "-n", k8s_namespace, kind), f"{kind} to go")
    wait_until(
        lambda: (
            not kube.core.list_namespaced_pod(
                k8s_namespace, label_selector="ladle.dev/inferenceservice=chat"
            ).items
        ),
        "the runtime pods to go",
    )


def test_missing_gpus_say_degraded_in_the_schedulers_words(kube: Kube, k8s_namespace: str) -> None:
    # No node offers this pool's GPU resource.
    pool = f"{k8s_namespace}-none"
    kube.apply(pool_manifest(pool, nodeSelector={}, resourceName="example.com/missing-gpu"))
    kube.apply(isvc_manifest("huge", gpuPool=pool), k8s_namespace)
    # Ready, not Degraded, is what to wait for: a status written before the informer saw the
    # new Service says ServiceNotCreated there, with Degraded already InsufficientGPUs.
    obj = kube.wait_condition(k8s_namespace, "huge", "Ready", "False", reason="InsufficientGPUs")
    degraded = kube.condition(obj, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InsufficientGPUs")
    assert degraded["message"].startswith("1 pod of Deployment huge-stable cannot be scheduled: ")
    assert "Insufficient example.com/missing-gpu" in degraded["message"]
    kube.wait_event(k8s_namespace, "huge", "Warning", "InsufficientGPUs")

    # Asking for what fits (running on CPU) heals it.
    kube.apply(isvc_manifest("huge", gpuPool=pool, resources={"gpus": 0}), k8s_namespace)
    obj = kube.wait_condition(k8s_namespace, "huge", "Ready")
    assert kube.condition(obj, "Degraded")["status"] == "False"
    kube.wait_event(k8s_namespace, "huge", "Normal", "Recovered")
    kube.kubectl("delete", "-n", k8s_namespace, "lisvc", "huge", "--wait=false")
    kube.kubectl("delete", "gpupool", pool, "--wait=false")


def test_missing_pool_is_degraded_and_a_generation_it_blocks_never_reads_ready(
    kube: Kube, k8s_namespace: str
) -> None:
    pool = f"{k8s_namespace}-late"
    kube.apply(isvc_manifest("chat", gpuPool=pool), k8s_namespace)
    obj = kube.wait_condition(k8s_namespace, "chat", "Degraded", reason="GPUPoolNotFound")
    assert f'GPUPool "{pool}" does not exist' in kube.condition(obj, "Degraded")["message"]
    assert gone(kube, "-n", k8s_namespace, "deployment/chat-stable")
    try:
        kube.apply(pool_manifest(pool, product="NVIDIA-H200"))
        kube.wait_condition(k8s_namespace, "chat", "Ready")
        pod_spec = deployment(kube, k8s_namespace, "chat-stable").spec.template.spec
        assert pod_spec.node_selector == {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H200",
        }

        # The pool goes anyway (an admin forces it past its finalizer), then the spec changes:
        # the Deployment still runs generation 1, so generation 2 must not read as Ready.
        kube.kubectl("delete", "gpupool", pool, "--wait=false")
        kube.kubectl(
            "patch", "gpupool", pool, "--type=merge", "-p", '{"metadata":{"finalizers":null}}'
        )
        wait_until(lambda: gone(kube, "gpupool", pool), "the pool to go")
        kube.apply(isvc_manifest("chat", gpuPool=pool, engine={"maxModelLen": 1024}), k8s_namespace)
        obj = kube.wait_condition(k8s_namespace, "chat", "Ready", "False", "GPUPoolNotFound")
        assert obj["status"]["observedGeneration"] == 2
        assert kube.condition(obj, "Stalled")["status"] == "True"
        assert kube.condition(obj, "Progressing")["reason"] == "GPUPoolNotFound"
        args = deployment(kube, k8s_namespace, "chat-stable").spec.template.spec.containers[0].args
        assert "--max-model-len" not in args
    finally:
        kube.kubectl("delete", "gpupool", pool, "--wait=false")


def test_ready_waits_for_a_service_the_api_server_refuses(kube: Kube, k8s_namespace: str) -> None:
    """Ready promises a working URL: a namespace quota that forbids Services keeps the
    InferenceService unready, in the API server's words, until the quota goes."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-services"},
        "spec": {"hard": {"services": "0"}},
    }
    kube.apply(yaml.safe_dump(quota), k8s_namespace)
    wait_until(
        lambda: (
            kube.kubectl(
                "get",
                "-n",
                k8s_namespace,
                "resourcequota/no-services",
                "-o",
                "jsonpath={.status.hard}",
            ).stdout
        ),
        "the quota controller to take the quota in",
    )
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    obj = kube.wait_condition(k8s_namespace, "chat", "Degraded", reason="ServiceNotCreated")
    ready = kube.condition(obj, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ServiceNotCreated")
    assert ready["message"].startswith("Service chat could not be created: 403")
    assert "exceeded quota: no-services" in ready["message"]
    wait_until(
        lambda: deployment(kube, k8s_namespace, "chat-stable").status.available_replicas == 1,
        "the replica to come up meanwhile",
    )
    assert kube.condition(kube.isvc(k8s_namespace, "chat"), "Ready")["status"] == "False"

    kube.kubectl("delete", "-n", k8s_namespace, "resourcequota/no-services")
    obj = kube.wait_condition(k8s_namespace, "chat", "Ready")
    assert kube.condition(obj, "Degraded")["status"] == "False"
    assert not gone(kube, "-n", k8s_namespace, "service/chat")


@pytest.mark.parametrize(
    ("theirs", "create", "reason"),
    [
        ("service/chat", ["service", "clusterip", "chat", "--tcp=80:8080"], "ServiceNotCreated"),
        (
            "deployment/chat-stable",
            ["deployment", "chat-stable", "--image=theirs"],
            "ChildConflict",
        ),
    ],
)
def test_someone_elses_object_with_a_childs_name_is_never_taken_over(
    kube: Kube, k8s_namespace: str, theirs: str, create: list[str], reason: str
) -> None:
    def get() -> dict[str, Any]:
        got = kube.kubectl("get", "-n", k8s_namespace, theirs, "-o", "json")
        assert got.returncode == 0, got.stderr
        return dict(json.loads(got.stdout))

    made = kube.kubectl("create", *create, "-n", k8s_namespace)
    assert made.returncode == 0, made.stderr
    before = get()
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    obj = kube.wait_condition(k8s_namespace, "chat", "Degraded", reason=reason)
    ready = kube.condition(obj, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", reason)
    kind, name = theirs.split("/")
    assert f"{kind.capitalize()} {name} exists and is not ours" in ready["message"]
    assert "kubectl-create" in ready["message"]  # whose it is
    after = get()
    assert after["spec"] == before["spec"]
    assert "ownerReferences" not in after["metadata"]

    # Once its owner removes it, the operator's own object takes the name.
    kube.kubectl("delete", "-n", k8s_namespace, theirs)
    kube.wait_condition(k8s_namespace, "chat", "Ready", timeout=90)
    assert get()["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"


def test_a_name_taken_mid_life_blocks_the_new_generation(kube: Kube, k8s_namespace: str) -> None:
    """An edit needs a ConfigMap whose name someone else's object holds: the apply stops
    there, and the status says so instead of reporting the old Deployment as the new spec."""
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    made = kube.kubectl(
        "create", "configmap", "chat-stable-config", "--from-literal=a=b", "-n", k8s_namespace
    )
    assert made.returncode == 0, made.stderr
    # A served model name this long no longer fits in the pod's args.
    kube.apply(isvc_manifest("chat", model={"name": "m" * 250}), k8s_namespace)
    obj = kube.wait_condition(k8s_namespace, "chat", "Ready", "False", "ChildConflict")
    assert (
        "ConfigMap chat-stable-config exists and is not ours"
        in (kube.condition(obj, "Ready")["message"])
    )
    assert kube.condition(obj, "Stalled")["status"] == "True"
    args = deployment(kube, k8s_namespace, "chat-stable").spec.template.spec.containers[0].args
    assert "--config" not in args

    kube.kubectl("delete", "configmap", "chat-stable-config", "-n", k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready", timeout=90)
    args = deployment(kube, k8s_namespace, "chat-stable").spec.template.spec.containers[0].args
    assert args[-2:] == ["--config", "/etc/ladle/config/config.yaml"]


def test_an_apply_the_api_server_refuses_becomes_a_condition(
    kube: Kube, k8s_namespace: str
) -> None:
    """An admission policy refuses the Deployment of a new generation: the API server's words
    reach the status (not just the log), and the service heals once the policy goes."""
    name = f"{k8s_namespace}-no-seed"[:63]
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": ["apps"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["deployments"],
                    }
                ]
            },
            "validations": [
                {
                    "expression": "!object.spec.template.spec.containers.exists(c, "
                    "has(c.args) && '--seed' in c.args)",
                    "message": "this cluster does not allow pinned seeds",
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": k8s_namespace}}
            },
        },
    }
    kube.apply(isvc_manifest("chat"), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    probe = yaml.safe_dump(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "probe", "namespace": k8s_namespace},
            "spec": {
                "selector": {"matchLabels": {"app": "probe"}},
                "template": {
                    "metadata": {"labels": {"app": "probe"}},
                    "spec": {"containers": [{"name": "c", "image": "x", "args": ["--seed"]}]},
                },
            },
        }
    )
    try:
        kube.apply(yaml.safe_dump(policy))
        kube.apply(yaml.safe_dump(binding))
        wait_until(
            lambda: (
                "pinned seeds"
                in kube.kubectl("apply", "--dry-run=server", "-f", "-", stdin=probe).stderr
            ),
            "the admission policy to take effect",
        )
        kube.apply(isvc_manifest("chat", engine={"seed": 7}), k8s_namespace)
        obj = kube.wait_condition(k8s_namespace, "chat", "Ready", "False", "ApplyFailed")
        message = kube.condition(obj, "Ready")["message"]
        assert message.startswith("Deployment chat-stable: ")
        assert "this cluster does not allow pinned seeds" in message
        assert kube.condition(obj, "Stalled")["status"] == "True"
        assert kube.condition(obj, "Degraded")["reason"] == "ApplyFailed"
    finally:
        kube.kubectl("delete", "validatingadmissionpolicybinding", name, "--ignore-not-found")
        kube.kubectl("delete", "validatingadmissionpolicy", name, "--ignore-not-found")
    kube.wait_condition(k8s_namespace, "chat", "Ready", timeout=90)
    args = deployment(kube, k8s_namespace, "chat-stable").spec.template.spec.containers[0].args
    assert args[args.index("--seed") + 1] == "7"


def test_kubectl_scale_works_through_the_scale_subresource(kube: Kube, k8s_namespace: str) -> None:
    kube.apply(isvc_manifest("chat", maxReplicas=4), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    # One replica: a disruption budget could protect nothing, so there is none.
    assert gone(kube, "-n", k8s_namespace, "poddisruptionbudget/chat-stable")
    scaled = kube.kubectl("scale", "-n", k8s_namespace, "lisvc/chat", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    obj = kube.wait_condition(k8s_namespace, "chat", "Ready")
    assert obj["status"]["replicas"] == 3
    assert deployment(kube, k8s_namespace, "chat-stable").spec.replicas == 3
    scale = json.loads(
        kube.kubectl(
            "get", "-n", k8s_namespace, "lisvc", "chat", "--subresource=scale", "-o", "json"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 3, "selector": "ladle.dev/inferenceservice=chat"}
    assert not gone(kube, "-n", k8s_namespace, "poddisruptionbudget/chat-stable")

    kube.kubectl("scale", "-n", k8s_namespace, "lisvc/chat", "--replicas=1")
    wait_until(
        lambda: gone(kube, "-n", k8s_namespace, "poddisruptionbudget/chat-stable"),
        "the disruption budget to go with the second replica",
    )


def test_a_large_configuration_moves_into_a_config_map_and_back(
    kube: Kube, k8s_namespace: str
) -> None:
    long_path = "/opt/models/" + "very-long-model-folder-name-" * 10
    source = {"image": {"path": long_path}}
    kube.apply(isvc_manifest("chat", model={"name": "m", "source": source}), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    config_map = kube.core.read_namespaced_config_map("chat-stable-config", k8s_namespace)
    assert yaml.safe_load(config_map.data["config.yaml"])["model"] == long_path
    args = deployment(kube, k8s_namespace, "chat-stable").spec.template.spec.containers[0].args
    assert args[-2:] == ["--config", "/etc/ladle/config/config.yaml"]

    kube.apply(isvc_manifest("chat", model={"name": "m"}), k8s_namespace)
    kube.wait_condition(k8s_namespace, "chat", "Ready")
    wait_until(
        lambda: gone(kube, "-n", k8s_namespace, "configmap/chat-stable-config"),
        "the ConfigMap to be deleted once the flags fit",
    )
    args = deployment(kube, k8s_namespace, "chat-stable").spec.template.spec.containers[0].args
    assert "--config" not in args


def test_operator_serves_health_and_metrics(operator: OperatorProcess) -> None:
    assert operator.get("/healthz") == (200, "ok\n")
    assert operator.get("/readyz") == (200, "ok\n")
    status, text = operator.get("/metrics")
    assert status == 200
    for family in (
        "ladle_operator_reconcile_total",
        "ladle_operator_reconcile_errors_total",
        "ladle_operator_reconcile_duration_seconds_bucket",
        "ladle_operator_applies_total",
        "ladle_operator_leader",
        "process_resident_memory_bytes",
    ):
        assert family in text
    logs = [line for line in operator.log.read_text().splitlines() if line.startswith("{")]
    assert logs
    assert all("message" in json.loads(line) for line in logs)


def test_the_profiling_annotation_needs_a_key_and_says_so_once(
    kube: Kube, k8s_namespace: str
) -> None:
    """ladle.dev/profiling without spec.apiKeySecret: pods as they were, and one Warning Event
    however many reconciles follow; with a key, --profile-dir and its volume."""
    ns = k8s_namespace
    kube.apply(isvc_manifest("prof", resources={"gpus": 0}), ns)
    kube.wait_condition(ns, "prof", "Ready")
    before = deployment(kube, ns, "prof-stable").metadata.generation
    annotated = kube.kubectl("annotate", "-n", ns, "lisvc", "prof", "ladle.dev/profiling=enabled")
    assert annotated.returncode == 0, annotated.stderr
    (event,) = wait_until(
        lambda: [e for e in kube.event_objects(ns, "prof") if e.reason == "ProfilingNeedsAPIKey"],
        "the ProfilingNeedsAPIKey event",
    )
    assert event.type == "Warning"
    assert "spec.apiKeySecret is not set" in event.message
    assert deployment(kube, ns, "prof-stable").metadata.generation == before
    # Another reconcile, of a new spec, repeats no Event.
    kube.apply(isvc_manifest("prof", resources={"gpus": 0}, engine={"seed": 3}), ns)
    wait_until(
        lambda: "3" in deployment(kube, ns, "prof-stable").spec.template.spec.containers[0].args,
        "the new spec's Deployment",
    )
    kube.wait_condition(ns, "prof", "Ready")
    kube.kubectl("create", "secret", "generic", "prof-key", "-n", ns, "--from-literal=k=sk-1")
    kube.apply(
        isvc_manifest("prof", resources={"gpus": 0}, apiKeySecret={"name": "prof-key", "key": "k"}),
        ns,
    )
    ctr = wait_until(
        lambda: (
            (c := deployment(kube, ns, "prof-stable").spec.template.spec.containers[0])
            and "--profile-dir" in c.args
            and c
        ),
        "the runtime pods to get --profile-dir",
    )
    assert ctr.args[ctr.args.index("--profile-dir") + 1] == "/var/lib/ladle/profiles"
    mounts = {m.name: m.mount_path for m in ctr.volume_mounts}
    assert mounts["profiles"] == "/var/lib/ladle/profiles"
    events = [e for e in kube.event_objects(ns, "prof") if e.reason == "ProfilingNeedsAPIKey"]
    assert [e.count for e in events] == [1]
    kube.kubectl("delete", "-n", ns, "lisvc", "prof", "--wait=false")
