"""The children named after the InferenceService itself rather than a variant: the Service
behind status.url, the Gateway API Inference Extension's InferencePools, HTTPRoute and the
model rewrite its fallback needs, and the Secret its replica groups authenticate with. Pure,
like ``desired``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ladle.api import (
    FALLBACK_HEADER,
    HTTP_ROUTE_API_VERSION,
    HTTP_ROUTE_KIND,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    JSON,
    MODEL_REWRITE_API_VERSION,
    MODEL_REWRITE_KIND,
    GatewayRef,
    InferenceService,
)
from ladle.operator import groups
from ladle.operator.desired import selector_labels, service_metadata
from ladle.operator.runtime_pod import HTTP_PORT

SERVICE_PORT = 80
POOL_GROUP = INFERENCE_POOL_API_VERSION.split("/")[0]


@dataclass(frozen=True)
class Fallback:
    """The service a route falls back to: its pool, and the model it serves under."""

    service: str
    model: str


def route_fallback(fallback: Fallback | None, available: int) -> Fallback | None:
    """Where the route sends the service's model instead, if anywhere: to the fallback's pool
    while none of the service's replicas is available (scaled to zero, crash-looping,
    evicted). A GAIE gateway has no breaker, so the operator moves the route; it moves at the
    pace of the pods' readiness, and never for failures of pods that are ready."""
    return fallback if available == 0 else None


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


def desired_inference_pools(isvc: InferenceService, variants: Sequence[str]) -> list[JSON]:
    """The Gateway API Inference Extension's InferencePools for the service: one of the
    Service's selector (every variant's pods) on the runtime's port, naming the endpoint picker
    that a GAIE gateway asks which of them serves each request; with ``perVariant``, one more
    for each of ``variants`` (``<name>-<variant>``), of its pods only, with its own picker."""
    name = isvc.meta.name
    picker = isvc.spec.inference_pool.endpoint_picker.name or f"{name}-epp"
    pools = [_pool(isvc, service_metadata(isvc), selector_labels(name), picker)]
    if isvc.spec.inference_pool.per_variant:
        for variant in variants:
            metadata = {**service_metadata(isvc), "name": variant_pool_name(name, variant)}
            labels = selector_labels(name, variant)
            pools.append(_pool(isvc, metadata, labels, f"{picker}-{variant}"))
    return pools


def variant_pool_name(isvc_name: str, variant: str) -> str:
    return f"{isvc_name}-{variant}"


def _pool(isvc: InferenceService, metadata: JSON, labels: dict[str, str], picker: str) -> JSON:
    options = isvc.spec.inference_pool.endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API_VERSION,
        "kind": INFERENCE_POOL_KIND,
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "name": picker,
                "port": {"number": options.port},
                "failureMode": options.failure_mode,
            },
        },
    }


def _pool_ref(pool: str, **fields: Any) -> JSON:
    """A reference to an InferencePool, as a route's backend (with ``fields``) or a rewrite's
    pool."""
    return {"group": POOL_GROUP, "kind": INFERENCE_POOL_KIND, "name": pool, **fields}


# The header that GAIE's body-based router sets from a request's ``model``: how one Gateway
# sends each model to its own pool.
MODEL_HEADER = "X-Gateway-Model-Name"


def desired_http_route(
    isvc: InferenceService,
    gateway: GatewayRef,
    weights: Sequence[tuple[str, int]],
    fallback: Fallback | None = None,
) -> JSON:
    """The HTTPRoute from ``gateway`` to the service's InferencePool, for requests whose model
    (the header GAIE's body-based router sets) is the service's. With ``perVariant`` it goes to
    the variants' pools instead, at their ``weights`` (the rollout's, by variant): how the
    Gateway API splits traffic between backends, as in GAIE's conformance test of weights
    across two pools. Falling back, it goes to the fallback's pool alone, whose answers say
    so in a header as Ladle's gateway's do."""
    name = isvc.meta.name
    backends = [_pool_ref(name)]
    if fallback is not None:
        header = {"name": FALLBACK_HEADER, "value": fallback.service}
        modifier = {"type": "ResponseHeaderModifier", "responseHeaderModifier": {"set": [header]}}
        backends = [_pool_ref(fallback.service, filters=[modifier])]
    elif isvc.spec.inference_pool.per_variant:
        backends = [
            _pool_ref(variant_pool_name(name, variant), weight=weight)
            for variant, weight in weights
        ]
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
                    "backendRefs": backends,
                }
            ],
        },
    }


def desired_model_rewrite(isvc: InferenceService, fallback: Fallback) -> JSON:
    """GAIE's rewrite, in the fallback's pool, of the service's model to the fallback's: its
    pods serve only their own model name, and the fallback's picker rewrites the body when the
    route falls back to it (Ladle's gateway rewrites it itself)."""
    return {
        "apiVersion": MODEL_REWRITE_API_VERSION,
        "kind": MODEL_REWRITE_KIND,
        "metadata": {**service_metadata(isvc), "name": f"{isvc.meta.name}-fallback"},
        "spec": {
            "poolRef": _pool_ref(fallback.service),
            "rules": [
                {
                    "matches": [{"model": {"type": "Exact", "value": isvc.spec.served_model_name}}],
                    "targets": [{"modelRewrite": fallback.model}],
                }
            ],
        },
    }
