"""API semantics a mock server would hide: garbage collection, namespace finalization, CEL
validation in a CRD schema and RBAC for a ServiceAccount-scoped kubeconfig."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ladle_dev.pytest_plugin import KubeCluster, wait_until

pytestmark = pytest.mark.cluster


def _gone(read: Callable[[], object]) -> bool:
    try:
        read()
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def test_deleting_an_owner_garbage_collects_its_dependents(
    k8s_api: ApiClient, k8s_namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    owner = core.create_namespaced_config_map(
        k8s_namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    reference = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    for index in range(3):
        meta = client.V1ObjectMeta(name=f"dependent-{index}", owner_references=[reference])
        core.create_namespaced_config_map(k8s_namespace, client.V1ConfigMap(metadata=meta))
    bystander = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="bystander"))
    core.create_namespaced_config_map(k8s_namespace, bystander)

    core.delete_namespaced_config_map("owner", k8s_namespace, propagation_policy="Background")

    def dependents_gone() -> bool:
        names = {cm.metadata.name for cm in core.list_namespaced_config_map(k8s_namespace).items}
        return not any(name.startswith("dependent-") for name in names)

    wait_until(dependents_gone, "the garbage collector to delete the dependents")
    assert core.read_namespaced_config_map("bystander", k8s_namespace).metadata.name == "bystander"


def test_namespace_with_workloads_deletes_completely(k8s_api: ApiClient) -> None:
    core = client.CoreV1Api(k8s_api)
    name = f"t-delete-me-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_until(
        lambda: not _gone(lambda: core.read_namespaced_service_account("default", name)),
        "the default ServiceAccount",
    )
    core.create_namespaced_config_map(
        name, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="data"), data={"k": "v"})
    )
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="worker"),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="busybox")]),
    )
    core.create_namespaced_pod(name, pod)
    wait_until(
        lambda: core.read_namespaced_pod("worker", name).status.phase == "Running",
        "the pod to run on a fake node",
    )

    core.delete_namespace(name)

    # The pod has to go through graceful deletion (kwok's pod-delete stage) before the namespace
    # controller can remove its finalizer; only then does the namespace disappear.
    wait_until(lambda: _gone(lambda: core.read_namespace(name)), "the namespace to disappear")


@pytest.fixture
def widget_crd(k8s_api: ApiClient) -> Iterator[str]:
    """A cluster-scoped CRD, unique per test, whose schema carries a CEL rule."""
    ext = client.ApiextensionsV1Api(k8s_api)
    group = f"t{uuid.uuid4().hex[:8]}.ladle.test"
    name = f"widgets.{group}"
    schema = client.V1JSONSchemaProps(
        type="object",
        properties={
            "spec": client.V1JSONSchemaProps(
                type="object",
                properties={
                    "minReplicas": client.V1JSONSchemaProps(type="integer"),
                    "maxReplicas": client.V1JSONSchemaProps(type="integer"),
                },
                x_kubernetes_validations=[
                    client.V1ValidationRule(
                        rule="self.minReplicas <= self.maxReplicas",
                        message="minReplicas must not exceed maxReplicas",
                    )
                ],
            )
        },
    )
    crd = client.V1CustomResourceDefinition(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1CustomResourceDefinitionSpec(
            group=group,
            scope="Namespaced",
            names=client.V1CustomResourceDefinitionNames(
                plural="widgets", singular="widget", kind="Widget"
            ),
            versions=[
                client.V1CustomResourceDefinitionVersion(
                    name="v1",
                    served=True,
                    storage=True,
                    schema=client.V1CustomResourceValidation(open_apiv3_schema=schema),
                )
            ],
        ),
    )
    ext.create_custom_resource_definition(crd)

    def established() -> bool:
        conditions = ext.read_custom_resource_definition(name).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_until(established, f"CRD {name} to be Established")
    yield group
    ext.delete_custom_resource_definition(name)


def test_crd_cel_rule_rejects_a_bad_object_with_its_message(
    k8s_api: ApiClient, k8s_namespace: str, widget_crd: str
) -> None:
    custom = client.CustomObjectsApi(k8s_api)

    def widget(name: str, low: int, high: int) -> dict[str, object]:
        return {
            "apiVersion": f"{widget_crd}/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"minReplicas": low, "maxReplicas": high},
        }

    # The discovery cache of a fresh CRD can lag Established by a moment.
    def create_good() -> bool:
        try:
            custom.create_namespaced_custom_object(
                widget_crd, "v1", k8s_namespace, "widgets", widget("good", 1, 2)
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    wait_until(create_good, "the new CRD to be served")
    with pytest.raises(ApiException) as info:
        custom.create_namespaced_custom_object(
            widget_crd, "v1", k8s_namespace, "widgets", widget("bad", 3, 2)
        )
    assert info.value.status == 422
    assert "minReplicas must not exceed maxReplicas" in json.loads(info.value.body)["message"]


def test_service_account_kubeconfig_is_denied_beyond_its_role(
    k8s_cluster: KubeCluster,
    k8s_api: ApiClient,
    k8s_namespace: str,
    sa_kubeconfig: Callable[[str, str], Path],
) -> None:
    core = client.CoreV1Api(k8s_api)
    rbac = client.RbacAuthorizationV1Api(k8s_api)
    core.create_namespaced_service_account(
        k8s_namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    rbac.create_namespaced_role(
        k8s_namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="configmap-reader"),
            rules=[
                client.V1PolicyRule(
                    api_groups=[""], resources=["configmaps"], verbs=["get", "list", "watch"]
                )
            ],
        ),
    )
    rbac.create_namespaced_role_binding(
        k8s_namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="reader"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name="configmap-reader"
            ),
            subjects=[
                client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=k8s_namespace)
            ],
        ),
    )
    core.create_namespaced_config_map(
        k8s_namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="visible"))
    )
    kubeconfig = sa_kubeconfig(k8s_namespace, "reader")

    # What the Role grants works, through the Python client …
    with k8s_cluster.api_client(kubeconfig) as sa_api:
        sa_core = client.CoreV1Api(sa_api)
        names = [cm.metadata.name for cm in sa_core.list_namespaced_config_map(k8s_namespace).items]
        assert "visible" in names
        # … and everything else is forbidden: other verbs, other resources, other namespaces.
        denied = [
            lambda: sa_core.create_namespaced_config_map(
                k8s_namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="nope"))
            ),
            lambda: sa_core.list_namespaced_secret(k8s_namespace),
            lambda: sa_core.list_namespaced_config_map("default"),
            sa_core.list_node,
        ]
        for attempt in denied:
            with pytest.raises(ApiException) as info:
                attempt()
            assert info.value.status == 403

    # The real kubectl agrees, and names the ServiceAccount it was denied as.
    allowed = k8s_cluster.run_kubectl("get", "configmaps", "-o", "name", kubeconfig=kubeconfig)
    assert allowed.returncode == 0, allowed.stderr
    assert "configmap/visible" in allowed.stdout
    forbidden = k8s_cluster.run_kubectl("get", "secrets", kubeconfig=kubeconfig)
    assert forbidden.returncode != 0
    assert "Forbidden" in forbidden.stderr
    assert f"system:serviceaccount:{k8s_namespace}:reader" in forbidden.stderr
