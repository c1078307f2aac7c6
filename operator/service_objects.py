"""The children named after the InferenceService itself rather than a variant: the Service
behind status.url, the Gateway API Inference Extension's InferencePool and HTTPRoute, and the
Secret its replica groups authenticate with. Pure, like ``desired``."""

from __future__ import annotations

from ladle.api import (
    HTTP_ROUTE_API_VERSION,
    HTTP_ROUTE_KIND,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    JSON,
    GatewayRef,
    InferenceService,
)
from ladle.operator import groups
from ladle.operator.desired import selector_labels, service_metadata
from ladle.operator.runtime_pod import HTTP_PORT

SERVICE_PORT = 80


def group_secret(isvc: InferenceService, value: str) -> JSON:
    """The Secret every group of the service authenticates its ranks with, made once."""
    metadata = {**service_metadata(isvc), "name": groups.secret_name(isvc.meta.name)}
    return groups.secret(metadata, value)


def desired_service(isvc: InferenceService) -> JSON:
    """The Service behind status.url; it selects the pods of every variant."""
    name = isvc.meta.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": service_metadata(isvc),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [
                {"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def desired_inference_pool(isvc: InferenceService) -> JSON:
    """The Gateway API Inference Extension's InferencePool for the service: the Service's
    selector (every variant's pods) on the runtime's port, and the endpoint picker that a GAIE
    gateway asks which of them serves each request."""
    name = isvc.meta.name
    picker = isvc.spec.inference_pool.endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": service_metadata(isvc),
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "name": picker.name or f"{name}-epp",
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


# The header that GAIE's body-based router sets from a request's ``model``: how one Gateway
# sends each model to its own pool.
MODEL_HEADER = "X-Gateway-Model-Name"


def desired_http_route(isvc: InferenceService, gateway: GatewayRef) -> JSON:
    """The HTTPRoute from ``gateway`` to the service's InferencePool, for requests whose model
    (the header GAIE's body-based router sets) is the service's."""
    name = isvc.meta.name
    parent: JSON = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name}
    if gateway.namespace:
        parent["namespace"] = gateway.namespace
    if gateway.section_name:
        parent["sectionName"] = gateway.section_name
    return {
        "apiVersion": HTTP_ROUTE_API_VERSION,
        "kind": HTTP_ROUTE_KIND,
        "metadata": service_metadata(isvc),
        "spec": {
            "parentRefs": [parent],
            "rules": [
                {
                    "matches": [
                        {
                            "path": {"type": "PathPrefix", "value": "/"},
                            "headers": [
                                {
                                    "type": "Exact",
                                    "name": MODEL_HEADER,
                                    "value": isvc.spec.served_model_name,
                                }
                            ],
                        }
                    ],
                    "backendRefs": [
                        {
                            "group": INFERENCE_POOL_API_VERSION.split("/")[0],
                            "kind": INFERENCE_POOL_KIND,
                            "name": name,
                        }
                    ],
                }
            ],
        },
    }
